"""Snapshots, the one owner: the files (``files``: atomic save, safe load, markers, the resume
policy), the run directory and its lock (``rundir``), and what a snapshot holds and how a solver
writes, resumes and starts over (``content``)."""
from dptrain.snapshots.content import Snapshots, StateParts, capture, check_same_classes, check_same_start, restore
from dptrain.snapshots.files import (
    SNAPSHOT_FORMAT,
    check_snapshot,
    folder_given,
    free_space,
    good_snapshots,
    is_diverging,
    is_snapshot_file,
    list_snapshots,
    load_snapshot,
    load_tensors,
    mark_diverging,
    prune_snapshots,
    remove_stale_temporaries,
    resolve_resume,
    save_atomically,
    save_snapshot,
    snapshot_path,
)
from dptrain.snapshots.rundir import RunDir

__all__ = ["SNAPSHOT_FORMAT", "RunDir", "Snapshots", "StateParts", "capture", "check_same_classes",
           "check_same_start", "check_snapshot", "folder_given", "free_space", "good_snapshots", "is_diverging",
           "is_snapshot_file", "list_snapshots", "load_snapshot", "load_tensors", "mark_diverging",
           "prune_snapshots", "remove_stale_temporaries", "resolve_resume", "restore", "save_atomically",
           "save_snapshot", "snapshot_path"]
