"""From a record to a sample's pixels: the geometry of a sample (``geometry``: crop, resize,
mirror, per-sample RNG), the Python renderer (``render``), the region-of-interest JPEG decode
(``jpeg_crop``) and the native renderer that does all of it in one GIL-free call (``native``)."""
