"""The hardware side: machines (GPUs per node, NVLink, network, HBM, contention) and input paths (what
feeds the GPUs, a cited or measured rate), each loaded from its data file in ``profiles/`` with its source."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from benchmarks.scaling.profile import last_json_line

PROFILES = Path(__file__).resolve().parent / "profiles"
GB = 1e9  # bandwidths are in GB/s = 1e9 bytes/s, as nccl-tests reports them


@dataclass(frozen=True)
class Link:
    busbw_gbs: float
    """Bus bandwidth B (GB/s) in the nccl-tests sense; for a network, the node's NICs together."""
    alpha_us: float
    """Latency per algorithm step (one hop of a chunk)."""
    source: str


@dataclass(frozen=True)
class Machine:
    name: str
    gpus_per_node: int
    nvlink: Link
    network: Link | None
    nvls: Link | None = None
    """NVLink SHARP (single node only): alpha_us is paid once, not per step."""
    launch_us: float = 0.0
    """Fixed cost per collective (NCCL baseLat, ring/Simple)."""
    hbm_gbs: float = 0.0
    contention: float = 0.0
    """Fraction of the communication time that overlaps backward which backward loses to it."""
    sources: tuple[tuple[str, str], ...] = ()
    cpu_cores: int = 0
    """Physical CPU cores per node, for an input path priced in CPU time per image (0: unknown)."""


def _link(d: dict[str, Any] | None) -> Link | None:
    return Link(float(d["busbw_gbs"]), float(d["alpha_us"]), str(d["source"])) if d else None


def load_machine(path: Path) -> Machine:
    """A machine profile from its TOML file (see benchmarks/scaling/profiles/machines/dgx-h100.toml)."""
    try:
        d = tomllib.loads(path.read_text())
        return Machine(str(d["name"]), int(d["gpus_per_node"]), _link(d["nvlink"]), _link(d.get("network")),
                       _link(d.get("nvls")), float(d.get("launch_us", 0.0)), float(d["hbm_gbs"]),
                       float(d.get("contention", 0.0)),
                       tuple((k, str(v)) for k, v in d.items() if k.endswith("_source")), int(d.get("cpu_cores", 0)))
    except (KeyError, TypeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: not a machine profile ({e!r}); start from machines/dgx-h100.toml") from e


MACHINES: dict[str, Machine] = {p.stem: load_machine(p) for p in sorted((PROFILES / "machines").glob("*.toml"))}


@dataclass(frozen=True)
class InputPath:
    """An input pipeline's rate, stated with its source (``benchmarks/scaling/profiles/inputs.toml``): a
    cited rate per node, or ``dptrain data-bench``'s measurement on one node (CPU ms per image over
    all its threads, and one process's own ceiling, the GIL's). Never fitted from a scaling row."""

    name: str
    images_per_s_per_node: float = 0.0
    """A cited or measured rate for a whole node (0: derive it from the CPU time, if any)."""
    cpu_ms_per_image: float = 0.0
    """Host CPU time per image, all threads together (``data-bench``'s ``cpu_ms_per_image``)."""
    process_images_per_s: float = 0.0
    """One solver process's ceiling, whatever the cores (1 / the GIL held per image; 0: none)."""
    source: str = ""

    @property
    def stated(self) -> bool:
        """Whether the path has any rate; without one a prediction is compute and communication only."""
        return bool(self.images_per_s_per_node or self.cpu_ms_per_image or self.process_images_per_s)


def input_rates(path: InputPath | None, cpu_cores: int) -> tuple[float, float]:
    """(images/s per node, images/s per solver process) of ``path`` on a node of ``cpu_cores``
    physical cores; 0 where nothing bounds it. A node's rate is the stated one, else
    cores x 1000 / CPU ms per image (every core decoding, at the measuring host's speed per core)."""
    if path is None:
        return 0.0, 0.0
    node = path.images_per_s_per_node
    if not node and path.cpu_ms_per_image and cpu_cores:
        node = cpu_cores * 1e3 / path.cpu_ms_per_image
    return node, path.process_images_per_s


def input_path_from_data_bench(path: str | Path) -> InputPath:
    """dptrain's input path as ``dptrain data-bench`` measured it on one node of the machine being
    predicted (its last JSON line in ``path``): CPU ms per image, and images/s of one solver process
    at the defaults as that process's ceiling. Measured elsewhere, the per-process rate is that
    host's, not the target's: run it on the node."""
    r = last_json_line(path, ("cpu_ms_per_image", "images_per_s"), "`dptrain data-bench`")
    return InputPath("data-bench", cpu_ms_per_image=float(r["cpu_ms_per_image"]),
                     process_images_per_s=float(r["images_per_s"]),
                     source=f"{path}: dptrain data-bench, {r['images_per_s']:,.0f} img/s per process at "
                            f"{r['cpu_ms_per_image']} CPU ms per image on a host of {r.get('host_cores', '?')} cores")


def load_inputs(path: Path = PROFILES / "inputs.toml") -> dict[str, InputPath]:
    """The input paths of ``path`` by name ([paths.<name>] tables)."""
    try:
        d = tomllib.loads(Path(path).read_text())["paths"]
        return {k: InputPath(k, float(v.get("images_per_s_per_node", 0.0)), float(v.get("cpu_ms_per_image", 0.0)),
                             float(v.get("process_images_per_s", 0.0)), str(v["source"])) for k, v in d.items()}
    except (KeyError, TypeError, AttributeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: not an input-paths file ({e!r}); each [paths.NAME] needs a source") from e


INPUTS: dict[str, InputPath] = load_inputs()
