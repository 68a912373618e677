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
 * It refuses (returns -1 with a message in err, and Python hands the image to Pillow) what
 * it cannot decode as Pillow does: a stream libjpeg warns about (damaged data, whose
 * treatment varies between libjpeg versions), a progressive image with scans missing
 * (libjpeg versions fill in the missing coefficients differently), and sampling layouts
 * where a component's IDCT is scaled but not to full size (4:1:0 or 2x4 luma under DCT
 * scaling: libjpeg-turbo's jpeg_crop_scanline() mis-sizes such components, and skipping
 * can loop forever). A truncated stream is an error, as in Pillow.
 *
 * Python loads this file through ctypes (dptrain/data/transforms/jpeg_crop.py), which releases the
 * GIL for the whole call. Returns 0, or -1 with a message in err.
 */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

/* The IDCT output size of a component: one field in the jpeg6b API (Debian's
 * libjpeg62-turbo), separate horizontal and vertical fields in the jpeg7/8 APIs (Ubuntu's
 * libjpeg-turbo8). */
#if JPEG_LIB_VERSION >= 70
#define DPT_H_SIZE(c) ((c)->DCT_h_scaled_size)
#define DPT_V_SIZE(c) ((c)->DCT_v_scaled_size)
#define DPT_MIN_H_SIZE(ci) ((ci)->min_DCT_h_scaled_size)
#define DPT_MIN_V_SIZE(ci) ((ci)->min_DCT_v_scaled_size)
#else
#define DPT_H_SIZE(c) ((c)->DCT_scaled_size)
#define DPT_V_SIZE(c) ((c)->DCT_scaled_size)
#define DPT_MIN_H_SIZE(ci) ((ci)->min_DCT_scaled_size)
#define DPT_MIN_V_SIZE(ci) ((ci)->min_DCT_scaled_size)
#endif

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

/* A warning ends the decode like an error (libjpeg lets an application do so): running
 * out of data, because Pillow refuses a truncated image, and any other warning (damaged
 * data), so that Pillow decides what such a stream yields. Trace messages (level >= 0)
 * are ignored. */
static void dpt_emit_message(j_common_ptr cinfo, int level) {
  if (level < 0) dpt_error_exit(cinfo);
}

/* Route libjpeg's errors and warnings to jerr (the caller then sets jerr.jump with setjmp). */
static void dpt_errors_to(struct jpeg_decompress_struct *cinfo, struct dpt_error *jerr, char *err, int err_len) {
  memset(cinfo, 0, sizeof(*cinfo));
  cinfo->err = jpeg_std_error(&jerr->pub);
  jerr->pub.error_exit = dpt_error_exit;
  jerr->pub.emit_message = dpt_emit_message;
  jerr->msg = err;
  jerr->msg_len = err_len;
}

/* What the crop decode cannot take once decompression has started: NULL, or the reason. */
static const char *dpt_refusal(const struct jpeg_decompress_struct *cinfo) {
  if (cinfo->progressive_mode) { /* a coefficient not fully sent (bits still to come, or never scanned) */
    for (int ci = 0; ci < cinfo->num_components; ci++)
      for (int k = 0; k < DCTSIZE2; k++)
        if (cinfo->coef_bits[ci][k] != 0) return "progressive image with scans missing";
  }
  for (int ci = 0; ci < cinfo->num_components; ci++) {
    const jpeg_component_info *c = &cinfo->comp_info[ci];
    int scaled = DPT_H_SIZE(c) != DPT_MIN_H_SIZE(cinfo) || DPT_V_SIZE(c) != DPT_MIN_V_SIZE(cinfo);
    int full_size = c->h_samp_factor * DPT_H_SIZE(c) == cinfo->max_h_samp_factor * DPT_MIN_H_SIZE(cinfo) &&
                    c->v_samp_factor * DPT_V_SIZE(c) == cinfo->max_v_samp_factor * DPT_MIN_V_SIZE(cinfo);
    if (scaled && !full_size) return "a component's IDCT is scaled but not to full size (sampling layout)";
  }
  return NULL;
}

/* Decode the box (x0, y0, width x height of the started decode's output) into out, rows of width *
 * output_components bytes, mirrored left-right if flip, and read the stream to its end. The caller
 * has called jpeg_start_decompress, checked dpt_refusal and the box, and set up the setjmp that
 * libjpeg's errors return to; *row (freed by the caller, also after a longjmp) holds the strip. */
static void dpt_read_box(struct jpeg_decompress_struct *cinfo, int x0, int y0, int width, int height, int flip,
                         unsigned char *out, unsigned char *volatile *row) {
  int channels = cinfo->output_components;
  int full_w = (int)cinfo->output_width, full_h = (int)cinfo->output_height;
  JSAMPROW line;
  /* Widen by one iMCU each side (where the image goes on) so that the box stays inside the
   * strip the upsampler sees; jpeg_crop_scanline() then aligns the start down to an iMCU. */
  int imcu = cinfo->max_h_samp_factor * DPT_MIN_H_SIZE(cinfo);
  int left = x0 - imcu < 0 ? 0 : x0 - imcu;
  int right = x0 + width + imcu > full_w ? full_w : x0 + width + imcu;
  JDIMENSION strip_x = (JDIMENSION)left, strip_w = (JDIMENSION)(right - left);
  if (strip_w < (JDIMENSION)full_w) jpeg_crop_scanline(cinfo, &strip_x, &strip_w);

  *row = (unsigned char *)malloc((size_t)strip_w * (size_t)channels);
  if (*row == NULL) ERREXIT(cinfo, JERR_OUT_OF_MEMORY);
  line = *row;
  if (y0 > 0) jpeg_skip_scanlines(cinfo, (JDIMENSION)y0);
  size_t row_bytes = (size_t)width * (size_t)channels;
  const unsigned char *src_start = line + (size_t)(x0 - (int)strip_x) * (size_t)channels;
  for (int y = 0; y < height; y++) {
    jpeg_read_scanlines(cinfo, &line, 1);
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
  if (below > 1) jpeg_skip_scanlines(cinfo, (JDIMENSION)(below - 1));
  if (below > 0) jpeg_read_scanlines(cinfo, &line, 1);
  jpeg_finish_decompress(cinfo);
}

int dptrain_jpeg_crop(const unsigned char *data, unsigned long size, int scale_denom, int gray,
                      int x0, int y0, int width, int height, int flip,
                      unsigned char *out, char *err, int err_len) {
  struct jpeg_decompress_struct cinfo;
  struct dpt_error jerr;
  unsigned char *volatile row = NULL; /* volatile: it is freed after a longjmp */
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
  jpeg_start_decompress(&cinfo); /* a progressive stream is read whole here */

  const char *refusal = dpt_refusal(&cinfo);
  if (refusal != NULL) {
    snprintf(err, (size_t)err_len, "%s", refusal);
    jpeg_destroy_decompress(&cinfo);
    return -1;
  }
  int full_w = (int)cinfo.output_width, full_h = (int)cinfo.output_height;
  if (x0 < 0 || y0 < 0 || width <= 0 || height <= 0 || x0 + width > full_w || y0 + height > full_h ||
      cinfo.output_components != channels) {
    snprintf(err, (size_t)err_len, "box %d,%d %dx%d outside the %dx%d decoded image (%d components)",
             x0, y0, width, height, full_w, full_h, cinfo.output_components);
    jpeg_destroy_decompress(&cinfo);
    return -1;
  }
  dpt_read_box(&cinfo, x0, y0, width, height, flip, out, &row);
  free(row);
  jpeg_destroy_decompress(&cinfo);
  return 0;
}
