/* Test helper: write a JPEG with any sampling factors (Pillow writes only 4:4:4, 4:2:2 and
 * 4:2:0), baseline or progressive, with the system libjpeg. Loaded through ctypes by
 * tests/unit/test_jpeg_crop.py. Returns 0, or -1 if the file cannot be opened. */
#include <stdio.h>

#include <jpeglib.h>

int dpt_test_encode(const unsigned char *pixels, int width, int height, int components, const int *h_samp,
                    const int *v_samp, int progressive, int quality, const char *path) {
  struct jpeg_compress_struct c;
  struct jpeg_error_mgr e;
  FILE *f = fopen(path, "wb");
  if (f == NULL) return -1;
  c.err = jpeg_std_error(&e);
  jpeg_create_compress(&c);
  jpeg_stdio_dest(&c, f);
  c.image_width = (JDIMENSION)width;
  c.image_height = (JDIMENSION)height;
  c.input_components = components;
  c.in_color_space = components == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, quality, TRUE);
  for (int i = 0; i < components; i++) {
    c.comp_info[i].h_samp_factor = h_samp[i];
    c.comp_info[i].v_samp_factor = v_samp[i];
  }
  if (progressive) jpeg_simple_progression(&c);
  jpeg_start_compress(&c, TRUE);
  for (int y = 0; y < height; y++) {
    JSAMPROW row = (JSAMPROW)(pixels + (size_t)y * (size_t)width * (size_t)components);
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  jpeg_destroy_compress(&c);
  fclose(f);
  return 0;
}
