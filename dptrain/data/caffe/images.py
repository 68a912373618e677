"""Reading an encoded image file as Caffe's ``convert_imageset`` does (OpenCV's ``imread``): header
first, decompression bombs refused, EXIF orientation applied, 16-bit grey cut to its high byte.

``dptrain make-lmdb`` reads its input files with these functions and training decodes records and
image files with them, so a file make-lmdb accepts decodes the same way in training.
"""
from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from dptrain.errors import DataError

GRAY_MODES = ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "I;16N", "F")
"""Pillow modes of one-channel images (LA: grey with alpha, which is dropped)."""
_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N")

# Pillow warns (DecompressionBombWarning, printed raw with a source line of Pillow's) when an image has
# more than MAX_IMAGE_PIXELS pixels and raises above twice that. open_image refuses every such image
# itself, with a DataError naming the record, so Pillow's copy of the message is silenced for the
# process: a filter around each call (warnings.catch_warnings) would not be thread-safe, and the
# renderer threads open images concurrently.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def open_image(data: bytes) -> Image.Image:
    """Open an encoded image lazily (header only), refusing decompression bombs, turned upright.

    A bomb is an image of more than ``PIL.Image.MAX_IMAGE_PIXELS`` pixels (Pillow's own limit, which
    the native renderer also applies): a :class:`DataError` here, and no warning of Pillow's.

    An EXIF orientation other than 1 is applied (the image is then decoded here, so JPEG
    draft mode does not apply to it), as OpenCV's ``imread`` does for Caffe's
    ``convert_imageset``: a phone photo tagged "rotate 90" trains upright, not sideways.
    """
    try:
        im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise DataError(f"decompression bomb: {e}") from e
    except UnidentifiedImageError as e:  # its text shows only the BytesIO's repr
        raise DataError("undecodable image (not a format Pillow recognises)") from e
    except (OSError, SyntaxError, ValueError) as e:
        raise DataError(f"undecodable image ({e})") from e
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and im.size[0] * im.size[1] > limit:
        raise DataError(f"decompression bomb: {im.size[0]}x{im.size[1]} pixels exceeds "
                        f"PIL.Image.MAX_IMAGE_PIXELS = {limit}")
    if "exif" in im.info:  # Pillow keeps the raw EXIF block there; most images have none
        try:
            if im.getexif().get(ExifTags.Base.Orientation, 1) != 1:
                im = ImageOps.exif_transpose(im)
        except (OSError, SyntaxError, ValueError) as e:
            raise DataError(f"undecodable image ({e})") from e
    return im


def convert_image(im: Image.Image, mode: str) -> Image.Image:
    """``im`` in ``mode`` ("RGB" or "L"). 16-bit grey keeps its high byte (what OpenCV, and so
    Caffe, does); Pillow's own ``convert`` would clip every value above 255 to white."""
    if im.mode in _SIXTEEN_BIT:
        im = Image.fromarray((np.asarray(im) >> 8).astype(np.uint8), "L")
    return im if im.mode == mode else im.convert(mode)
