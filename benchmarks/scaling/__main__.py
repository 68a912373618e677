"""``python -m benchmarks.scaling``: the scaling model's command (:func:`benchmarks.scaling.cli.main`)."""
from benchmarks.scaling.cli import main

raise SystemExit(main())
