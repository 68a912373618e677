from dptrain.cli import run

run()
