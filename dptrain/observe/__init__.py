"""What a run records about itself: ``trace`` (phase timers, Chrome traces), ``metrics``
(metrics.jsonl and TensorBoard) and ``provenance`` (the git commit of a record)."""
