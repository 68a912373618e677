"""The Caffe formats: the ``Datum`` and ``BlobProto`` records (``datum``) and the LMDB writer behind
``dptrain make-lmdb`` (``make_lmdb``)."""
