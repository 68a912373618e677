/* Region-of-interest JPEG decode for dptrain's transformer threads.
 *
 * dptrain_jpeg_crop() decodes only the pixels of one box of a JPEG (optionally DCT-scaled
 * by 1/2, 1/4 or 1/8) with libjpeg-turbo's jpeg_crop_scanline() and jpeg_skip_scanlines():
 * rows above the box are entropy-decoded and dropped without an inverse DCT, columns
 * outside it get no inverse DCT, upsampling or colour conversion, and rows below it are
 * entropy-decoded only, so that a damaged or truncated stream is still refused. The
 * output pixels equal a full decode's (ISLOW DCT, fancy upsampling, as Pillow decodes):
 * the decoded strip is widened by one iMCU on each side wherever the image continues, so
 * the fancy upsampler never sees the strip's edge inside the box.
 *
 * Python loads this file through ctypes (dptrain/data/jpeg_crop.py), which releases the
 * GIL for the whole call. Returns 0, or -1 with a message in err.
 */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

struct dpt_error {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
  char *msg;
  int msg_len;
};

static void dpt_error_exit(j_common_ptr cinfo) {
  struct dpt_error *e = (struct dpt_error *)cinfo->err;
  char text[JMSG_LENGTH_MAX];
  (*cinfo->err->format_message)(cinfo, text);
  snprintf(e->msg, (size_t)e->msg_len, "%s", text);
  longjmp(e->jump, 1);
}

/* Warnings are ignored, as Pillow ignores them, except running out of data: Pillow
 * refuses a truncated image, and so does this decoder. */
static void dpt_emit_message(j_common_ptr cinfo, int level) {
  if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) dpt_error_exit(cinfo);
}

/* Route libjpeg's errors to jerr (the caller then sets jerr.jump with setjmp). */
static void dpt_errors_to(struct jpeg_decompress_struct *cinfo, struct dpt_error *jerr, char *err, int err_len) {
  memset(cinfo, 0, sizeof(*cinfo));
  cinfo->err = jpeg_std_error(&jerr->pub);
  jerr->pub.error_exit = dpt_error_exit;
  jerr->pub.emit_message = dpt_emit_message;
  jerr->msg = err;
  jerr->msg_len = err_len;
}

/* The stored image's header: info = {width, height, components, flags}; flags bit 0: an
 * EXIF block (APP1 "Exif"), bit 1: a multi-picture index (APP2 "MPF"). Python leaves
 * flagged files to Pillow, which applies EXIF orientation and reads MPO files. */
int dptrain_jpeg_header(const unsigned char *data, unsigned long size, int *info, char *err, int err_len) {
  struct jpeg_decompress_struct cinfo;
  struct dpt_error jerr;

  dpt_errors_to(&cinfo, &jerr, err, err_len);
  if (setjmp(jerr.jump)) {
    jpeg_destroy_decompress(&cinfo);
    return -1;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, size);
  jpeg_save_markers(&cinfo, JPEG_APP0 + 1, 8);
  jpeg_save_markers(&cinfo, JPEG_APP0 + 2, 8);
  jpeg_read_header(&cinfo, TRUE);
  info[0] = (int)cinfo.image_width;
  info[1] = (int)cinfo.image_height;
  info[2] = cinfo.num_components;
  info[3] = 0;
  for (jpeg_saved_marker_ptr m = cinfo.marker_list; m != NULL; m = m->next) {
    if (m->marker == JPEG_APP0 + 1 && m->data_length >= 6 && memcmp(m->data, "Exif\0\0", 6) == 0) info[3] |= 1;
    if (m->marker == JPEG_APP0 + 2 && m->data_length >= 4 && memcmp(m->data, "MPF\0", 4) == 0) info[3] |= 2;
  }
  jpeg_destroy_decompress(&cinfo);
  return 0;
}

int dptrain_jpeg_crop(const unsigned char *data, unsigned long size, int scale_denom, int gray,
                      int x0, int y0, int width, int height, int flip,
                      unsigned char *out, char *err, int err_len) {
  struct jpeg_decompress_struct cinfo;
  struct dpt_error jerr;
  unsigned char *volatile row = NULL; /* volatile: it is freed after a longjmp */
  JSAMPROW line;
  int channels = gray ? 1 : 3;

  dpt_errors_to(&cinfo, &jerr, err, err_len);
  if (setjmp(jerr.jump)) {
    free(row);
    jpeg_destroy_decompress(&cinfo);
    return -1;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, size);
  jpeg_read_header(&cinfo, TRUE);
  cinfo.out_color_space = gray ? JCS_GRAYSCALE : JCS_RGB;
  cinfo.scale_num = 1;
  cinfo.scale_denom = (unsigned int)scale_denom;
  cinfo.dct_method = JDCT_ISLOW;
  cinfo.do_fancy_upsampling = TRUE;
  jpeg_start_decompress(&cinfo);

  int full_w = (int)cinfo.output_width, full_h = (int)cinfo.output_height;
  if (x0 < 0 || y0 < 0 || width <= 0 || height <= 0 || x0 + width > full_w || y0 + height > full_h ||
      cinfo.output_components != channels) {
    snprintf(err, (size_t)err_len, "box %d,%d %dx%d outside the %dx%d decoded image (%d components)",
             x0, y0, width, height, full_w, full_h, cinfo.output_components);
    jpeg_destroy_decompress(&cinfo);
    return -1;
  }
  /* Widen by one iMCU each side (where the image goes on) so that the box stays inside the
   * strip the upsampler sees; jpeg_crop_scanline() then aligns the start down to an iMCU. */
  int imcu = cinfo.max_h_samp_factor * cinfo.min_DCT_scaled_size;
  int left = x0 - imcu < 0 ? 0 : x0 - imcu;
  int right = x0 + width + imcu > full_w ? full_w : x0 + width + imcu;
  JDIMENSION strip_x = (JDIMENSION)left, strip_w = (JDIMENSION)(right - left);
  if (strip_w < (JDIMENSION)full_w) jpeg_crop_scanline(&cinfo, &strip_x, &strip_w);

  row = (unsigned char *)malloc((size_t)strip_w * (size_t)channels);
  if (row == NULL) ERREXIT(&cinfo, JERR_OUT_OF_MEMORY);
  line = row;
  if (y0 > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)y0);
  size_t row_bytes = (size_t)width * (size_t)channels;
  const unsigned char *src_start = row + (size_t)(x0 - (int)strip_x) * (size_t)channels;
  for (int y = 0; y < height; y++) {
    jpeg_read_scanlines(&cinfo, &line, 1);
    unsigned char *dst = out + (size_t)y * row_bytes;
    if (!flip) {
      memcpy(dst, src_start, row_bytes);
    } else if (channels == 3) {  /* a loop per channel count: a memcpy call per pixel costs a third of the decode */
      const unsigned char *src = src_start + row_bytes - 3;
      for (int x = 0; x < width; x++, dst += 3, src -= 3) {
        dst[0] = src[0];
        dst[1] = src[1];
        dst[2] = src[2];
      }
    } else {
      for (int x = 0; x < width; x++) dst[x] = src_start[width - 1 - x];
    }
  }
  /* The rows below the box: skipping stops one short of the end (a skip to the end returns
   * without decoding), and the last row is read, so the whole stream is entropy-decoded
   * and a damaged or truncated tail raises as it does in a full decode. */
  int below = full_h - (y0 + height);
  if (below > 1) jpeg_skip_scanlines(&cinfo, (JDIMENSION)(below - 1));
  if (below > 0) jpeg_read_scanlines(&cinfo, &line, 1);
  jpeg_finish_decompress(&cinfo);
  free(row);
  jpeg_destroy_decompress(&cinfo);
  return 0;
}
