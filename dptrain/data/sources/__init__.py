"""Where samples come from: the built-in digits and synthetic sets (``builtin``) and Caffe LMDBs
(``caffe_lmdb``). Each is a :class:`dptrain.data.base.DataSource`; ``dptrain.data.build_source``
picks one from ``data.source``."""
