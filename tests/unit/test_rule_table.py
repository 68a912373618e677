"""kernels.spec.RULES is the one table of update rules: every other list derives from it or is checked here."""
from __future__ import annotations

import re
import typing
from pathlib import Path

from dptrain.config import SolverConfig
from dptrain.kernels import cuda, native
from dptrain.kernels.spec import RULES
from dptrain.optimizer import RULE_OF_TYPE

CSRC = Path(native.__file__).resolve().parents[1] / "csrc"


def test_config_types_and_the_optimizer_mapping_agree_with_the_rule_table():
    types = set(typing.get_args(typing.get_type_hints(SolverConfig)["type"]))
    assert types == set(RULE_OF_TYPE), "solver.type's choices and optimizer.RULE_OF_TYPE differ"
    assert set(RULE_OF_TYPE.values()) == set(RULES), "a rule without a solver.type, or a type without a rule"
    aliases = {t: r for t, r in RULE_OF_TYPE.items() if t != r}
    assert aliases == {"adamw": "adam"}  # adam and adamw are one rule, told apart by decay_mode


def test_native_codes_and_dispatch_derive_from_the_rule_table():
    assert list(native.RULE_CODES) == list(RULES) and list(native.RULE_CODES.values()) == list(range(len(RULES)))
    macro = native.rules_macro()
    assert macro == "-DDPT_RULES(X)=" + " ".join(f"X({i}, {r.functor})" for i, r in enumerate(RULES.values()))
    source = (CSRC / "update_cpu.cc").read_text()
    assert "DPT_RULES(DPT_RULE_CASE)" in source
    assert not re.search(r"case \d+: return by_storage<dpt::", source), "update_cpu.cc lists rules by hand again"
    kernels = (CSRC / "update.cu").read_text()
    for rule in RULES.values():  # each functor and each CUDA kernel the dispatch names exists in update.cu
        assert re.search(rf"struct {re.escape(rule.functor.split('::')[1].split('<')[0])}\b", kernels), rule.functor
        assert f"dptrain_{rule.name}_update" in kernels
        assert cuda.update_kernel_name(rule, next(iter(cuda.CTYPES)), rule.state_dtypes[0], 1).startswith(
            f"dptrain_{rule.name}_update<")
