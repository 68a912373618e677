"""The commands beside training: ``dptrain bench`` (``bench``), ``dptrain test`` (``evaluate``)
and ``dptrain plot`` (``plot``)."""
