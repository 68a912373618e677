/* The per-sample path of dptrain's input pipeline in one native call per chunk of records.
 *
 * dptrain_render_chunk() takes N serialised Caffe Datums (the values a parser thread read from
 * the LMDB) and, for each, without the GIL:
 *   1. parses the Datum (protobuf wire format: channels 1, height 2, width 3, data 4, label 5,
 *      float_data 6, encoded 7, record_id 8), checking every known field's wire type;
 *   2. plans the sample's geometry: the stage chain of dptrain/data/transforms/geometry.py (Resize, Crop,
 *      RandomResizedCrop, CenterResizedCrop, Mirror, ExpectSize), with the same counter-based
 *      splitmix64 RNG keyed by (seed, epoch, index, attempt) and the same double arithmetic, so
 *      its boxes and flips equal the Python stages' bit for bit (compiled with -ffp-contract=off);
 *   3. decodes only the needed region of a JPEG (jpeg_crop.c's decoder, with Pillow's draft scale
 *      when the box shrinks 2x or more), or takes it from a raw CHW BGR record;
 *   4. resamples it with Pillow's bilinear filter arithmetic (the separable antialiased filter
 *      with 22-bit fixed-point weights; horizontal pass, then vertical), mirrors it, and writes
 *      the [out_h, out_w, C] RGB (or grey) row of the ring slot, its label and its crop window.
 *
 * A record it does not take (not a JPEG or raw Datum, CMYK, an EXIF rotation, an MPO file, a
 * stream libjpeg warns about, float_data, no label or one out of range, a wire-type error, an image
 * Pillow would call a bomb, an image smaller than a crop) gets a non-zero status and is left to
 * the Python path (dptrain/data/transforms/render.py), which renders it or reports it as a bad record with
 * its own messages. So this file never decides that a record is bad: Pillow's verdict stands.
 *
 * Called from dptrain/data/transforms/native.py through ctypes, which releases the GIL for the call.
 * Reentrant: every buffer is allocated per call (dpt_work). Returns the number of records left to Python.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "jpeg_crop.c"

/* ---- Chunk arguments (layout mirrored by native_render._Chunk) ---- */

enum { STAGE_RESIZE = 1, STAGE_CROP = 2, STAGE_RRC = 3, STAGE_CENTER_RRC = 4, STAGE_MIRROR = 5, STAGE_EXPECT = 6 };
#define STAGE_WORDS 8 /* doubles per stage: op, then its parameters */

typedef struct {
  int32_t n;                          /* records in this chunk */
  int32_t channels;                   /* 3 (RGB) or 1 (grey) */
  int32_t out_h, out_w;               /* sample size after the stages */
  int32_t n_stages;
  int32_t num_classes;                /* labels must lie in [0, num_classes) */
  int32_t draft;                      /* JPEG draft mode (RenderOptions.draft) */
  int32_t with_windows;               /* write (y0, x0, flip) of each crop into windows */
  int64_t max_pixels;                 /* PIL.Image.MAX_IMAGE_PIXELS, or 0 for no limit */
  uint64_t seed;                      /* first key of each sample's RNG */
  const double *stages;               /* [n_stages * STAGE_WORDS] */
  const unsigned char *const *values; /* [n] the records' bytes */
  const uint64_t *lengths;            /* [n] */
  const uint64_t *epochs, *indices;   /* [n] RNG keys 2 and 3 (the attempt, key 4, is 0) */
  unsigned char *images;              /* [n, out_h, out_w, channels] uint8 */
  int64_t *labels;                    /* [n] */
  int32_t *windows;                   /* [n, 3] or NULL */
  int8_t *status;                     /* [n] out: 0 rendered, > 0 left to Python (a DPT_* reason) */
} dpt_chunk;

enum {
  DPT_OK = 0,
  DPT_UNPARSED = 1,   /* not a Datum this parser takes (wire-type error, groups, float_data, ...) */
  DPT_LABEL = 2,      /* no label field, or a label outside [0, num_classes) */
  DPT_FORMAT = 3,     /* encoded, but not a JPEG this path takes (PNG, CMYK, EXIF rotation, MPO) */
  DPT_GEOMETRY = 4,   /* a stage refuses the image (smaller than a crop, another size than expected) */
  DPT_DECODE = 5,     /* libjpeg refused or warned: Pillow decides */
  DPT_RAW = 6,        /* a raw record whose sizes disagree, or whose channels need a colour conversion */
  DPT_MEMORY = 7
};

/* ---- 1. The Datum ---- */

typedef struct {
  int64_t channels, height, width, label;
  int has_label; /* protobuf would read a missing label as 0: Python reports such a record */
  int encoded;
  const unsigned char *data;
  uint64_t data_len;
} dpt_datum;

static int dpt_varint(const unsigned char **p, const unsigned char *end, uint64_t *v) {
  uint64_t x = 0;
  for (int shift = 0; shift < 64 && *p < end; shift += 7) {
    unsigned char b = *(*p)++;
    x |= (uint64_t)(b & 0x7f) << shift;
    if (!(b & 0x80)) {
      *v = x;
      return 0;
    }
  }
  return -1;
}

/* Parse as protobuf (proto2) would: last value wins, unknown fields of wire types 0, 1, 2, 5 are
 * skipped. Anything the Python parser would treat otherwise (a known field of another wire type,
 * which it keeps as an unknown field, groups, float_data) returns DPT_UNPARSED. */
static int dpt_parse_datum(const unsigned char *p, uint64_t len, dpt_datum *d) {
  const unsigned char *end = p + len;
  memset(d, 0, sizeof(*d));
  while (p < end) {
    uint64_t tag, v;
    if (dpt_varint(&p, end, &tag)) return DPT_UNPARSED;
    uint64_t field = tag >> 3;
    int wire = (int)(tag & 7);
    if (field == 0) return DPT_UNPARSED;
    int known_varint = field == 1 || field == 2 || field == 3 || field == 5 || field == 7 || field == 8;
    if (known_varint && wire != 0) return DPT_UNPARSED;
    if ((field == 4 && wire != 2) || field == 6) return DPT_UNPARSED;
    switch (wire) {
      case 0:
        if (dpt_varint(&p, end, &v)) return DPT_UNPARSED;
        /* int32 fields keep the low 32 bits, as a sign-extended negative int32 arrives */
        if (field == 1) d->channels = (int32_t)(uint32_t)v;
        else if (field == 2) d->height = (int32_t)(uint32_t)v;
        else if (field == 3) d->width = (int32_t)(uint32_t)v;
        else if (field == 5) {
          d->label = (int32_t)(uint32_t)v;
          d->has_label = 1;
        }
        else if (field == 7) d->encoded = v != 0;
        break;
      case 1:
        if ((uint64_t)(end - p) < 8) return DPT_UNPARSED;
        p += 8;
        break;
      case 5:
        if ((uint64_t)(end - p) < 4) return DPT_UNPARSED;
        p += 4;
        break;
      case 2:
        if (dpt_varint(&p, end, &v) || v > (uint64_t)(end - p)) return DPT_UNPARSED;
        if (field == 4) {
          d->data = p;
          d->data_len = v;
        }
        p += v;
        break;
      default: /* groups (3, 4) and invalid wire types */
        return DPT_UNPARSED;
    }
  }
  return DPT_OK;
}

/* ---- 2. Geometry: geometry.py's stages and SampleRng ---- */

#define GOLDEN64 0x9E3779B97F4A7C15ULL

static uint64_t dpt_mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

typedef struct { uint64_t state; } dpt_rng;

static void dpt_rng_init(dpt_rng *r, const uint64_t *key, int n) {
  uint64_t s = 0;
  for (int i = 0; i < n; i++) s = dpt_mix64((s ^ key[i]) + GOLDEN64);
  r->state = s;
}

static uint64_t dpt_rng_next(dpt_rng *r) {
  r->state += GOLDEN64;
  return dpt_mix64(r->state);
}

static double dpt_random(dpt_rng *r) { return (double)(dpt_rng_next(r) >> 11) * (1.0 / 9007199254740992.0); }
static double dpt_uniform(dpt_rng *r, double lo, double hi) { return lo + (hi - lo) * dpt_random(r); }
static int64_t dpt_randint(dpt_rng *r, int64_t n) { return (int64_t)(dpt_rng_next(r) % (uint64_t)n); }
static int64_t dpt_round(double x) { return (int64_t)nearbyint(x); } /* Python's round(): half to even */

typedef struct {
  double box[4]; /* x0, y0, x1, y1 in stored-image pixels */
  int64_t out_w, out_h;
  int flip;
  dpt_rng rng;
} dpt_sample;

static void dpt_sub_box(dpt_sample *s, double x0, double y0, double w, double h) {
  double bx0 = s->box[0], by0 = s->box[1], bx1 = s->box[2], by1 = s->box[3];
  double sx = (bx1 - bx0) / (double)s->out_w, sy = (by1 - by0) / (double)s->out_h;
  s->box[0] = bx0 + x0 * sx;
  s->box[1] = by0 + y0 * sy;
  s->box[2] = bx0 + (x0 + w) * sx;
  s->box[3] = by0 + (y0 + h) * sy;
}

/* Each stage as geometry.py's __call__; DPT_GEOMETRY where Python raises a DataError. */
static int dpt_plan(dpt_sample *s, const double *stages, int n_stages) {
  for (int i = 0; i < n_stages; i++) {
    const double *a = stages + (size_t)i * STAGE_WORDS;
    switch ((int)a[0]) {
      case STAGE_RESIZE: /* height, width */
        s->out_h = (int64_t)a[1];
        s->out_w = (int64_t)a[2];
        break;
      case STAGE_CROP: { /* size, random */
        int64_t c = (int64_t)a[1], x0, y0;
        if (s->out_w < c || s->out_h < c) return DPT_GEOMETRY;
        if (a[2] != 0) {
          y0 = dpt_randint(&s->rng, s->out_h - c + 1); /* y first, as the Python tuple evaluates */
          x0 = dpt_randint(&s->rng, s->out_w - c + 1);
        } else {
          y0 = (s->out_h - c) / 2;
          x0 = (s->out_w - c) / 2;
        }
        dpt_sub_box(s, (double)x0, (double)y0, (double)c, (double)c);
        s->out_w = s->out_h = c;
        break;
      }
      case STAGE_RRC: { /* size, scale lo, scale hi, log ratio lo, log ratio hi, ratio lo, ratio hi */
        int64_t W = s->out_w, H = s->out_h, w = 0, h = 0;
        double area = (double)(W * H);
        int found = 0;
        for (int t = 0; t < 10 && !found; t++) { /* geometry.RRC_TRIES */
          double target = area * dpt_uniform(&s->rng, a[2], a[3]);
          double aspect = exp(dpt_uniform(&s->rng, a[4], a[5]));
          w = dpt_round(sqrt(target * aspect));
          h = dpt_round(sqrt(target / aspect));
          if (0 < w && w <= W && 0 < h && h <= H) {
            int64_t x0 = dpt_randint(&s->rng, W - w + 1);
            int64_t y0 = dpt_randint(&s->rng, H - h + 1);
            dpt_sub_box(s, (double)x0, (double)y0, (double)w, (double)h);
            found = 1;
          }
        }
        if (!found) {
          double aspect = (double)W / (double)H;
          if (aspect < a[6]) {
            w = W;
            h = dpt_round((double)W / a[6]);
          } else if (aspect > a[7]) {
            w = dpt_round((double)H * a[7]);
            h = H;
          } else {
            w = W;
            h = H;
          }
          dpt_sub_box(s, (double)((W - w) / 2), (double)((H - h) / 2), (double)w, (double)h);
        }
        s->out_w = s->out_h = (int64_t)a[1];
        break;
      }
      case STAGE_CENTER_RRC: { /* size, short side */
        int64_t size = (int64_t)a[1], short_side = (int64_t)a[2];
        int64_t m = s->out_w < s->out_h ? s->out_w : s->out_h;
        double side = (double)(size * m) / (double)short_side;
        dpt_sub_box(s, ((double)s->out_w - side) / 2, ((double)s->out_h - side) / 2, side, side);
        s->out_w = s->out_h = size;
        break;
      }
      case STAGE_MIRROR:
        s->flip = dpt_random(&s->rng) < 0.5;
        break;
      case STAGE_EXPECT: /* height, width */
        if (s->out_h != (int64_t)a[1] || s->out_w != (int64_t)a[2]) return DPT_GEOMETRY;
        break;
      default:
        return DPT_GEOMETRY;
    }
  }
  return DPT_OK;
}

/* ---- 4. Pillow's bilinear resample (ImagingResample with a float box), our own code ---- */

#define PRECISION_BITS 22 /* Pillow's 8-bit path: 32 - 8 - 2 */
#define H_BITS 14         /* the horizontal pass's weights: int16 (a weight is at most 2^14), as torch's
                             uint8 antialiased kernel keeps them; one rounding of each weight away from
                             Pillow's 22 bits, so a pixel can differ from Pillow's by one grey level */

/* Buffers that grow across the records of one call and are freed at its end, so that nothing is
 * allocated inside a decode that libjpeg may leave by longjmp. */
typedef struct {
  void *p;
  size_t size;
} dpt_buf;

static void *dpt_grow(dpt_buf *b, size_t need) {
  if (need > b->size) {
    void *q = realloc(b->p, need);
    if (q == NULL) return NULL;
    b->p = q;
    b->size = need;
  }
  return b->p;
}

typedef struct {
  dpt_buf region, tmp, acc, weights, k[2], bounds[2], pairs[2];
} dpt_work;

static void dpt_work_free(dpt_work *w) {
  dpt_buf *all[] = {&w->region, &w->tmp, &w->acc, &w->weights, &w->k[0], &w->k[1], &w->bounds[0], &w->bounds[1],
                    &w->pairs[0], &w->pairs[1]};
  for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) free(all[i]->p);
}

typedef struct {
  int ksize;
  int *bounds;      /* [out * 2]: first input pixel, taps */
  int32_t *k;       /* [out * ksize] weights, PRECISION_BITS fixed point (Pillow's) */
  int npairs;       /* ceil(ksize / 2) */
  uint32_t *pairs;  /* [out * npairs] the same weights in H_BITS fixed point as int16 pairs (tap 2j low,
                       2j + 1 high; 0 past the output's taps): the horizontal pass's, for pmaddwd */
} dpt_coeffs;

static double dpt_bilinear(double x) {
  if (x < 0.0) x = -x;
  return x < 1.0 ? 1.0 - x : 0.0;
}

/* Weights of out_size outputs over input pixels [0, in_size) for the box [in0, in1), as Pillow
 * computes them: the box in single precision, support 1 (bilinear) widened by the downscale.
 * which (0 or 1) picks the workspace buffers. */
static int dpt_coeffs_make(dpt_coeffs *c, dpt_work *work, int which, int in_size, float in0, float in1,
                           int out_size) {
  double scale = (double)(in1 - in0) / out_size;
  double filterscale = scale < 1.0 ? 1.0 : scale;
  double support = 1.0 * filterscale, ss = 1.0 / filterscale;
  int ksize = (int)ceil(support) * 2 + 1;
  double *w = (double *)dpt_grow(&work->weights, (size_t)ksize * sizeof(double));
  c->ksize = ksize;
  c->bounds = (int *)dpt_grow(&work->bounds[which], (size_t)out_size * 2 * sizeof(int));
  c->k = (int32_t *)dpt_grow(&work->k[which], (size_t)out_size * (size_t)ksize * sizeof(int32_t));
  c->npairs = (ksize + 1) / 2;
  c->pairs = (uint32_t *)dpt_grow(&work->pairs[which], (size_t)out_size * (size_t)c->npairs * sizeof(uint32_t));
  if (w == NULL || c->bounds == NULL || c->k == NULL || c->pairs == NULL || ksize > 63) return DPT_MEMORY;
  for (int xx = 0; xx < out_size; xx++) {
    double center = in0 + (xx + 0.5) * scale, sum = 0.0;
    int xmin = (int)(center - support + 0.5), xmax = (int)(center + support + 0.5);
    if (xmin < 0) xmin = 0;
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    for (int x = 0; x < xmax; x++) {
      w[x] = dpt_bilinear((x + xmin - center + 0.5) * ss);
      sum += w[x];
    }
    int32_t *k = c->k + (size_t)xx * ksize;
    uint16_t h16[64] = {0}; /* ksize <= 2 * ceil(support) + 1; support <= 31 for any box this path takes */
    for (int x = 0; x < ksize; x++) {
      double v = x >= xmax ? 0.0 : sum != 0.0 ? w[x] / sum : w[x];
      k[x] = (int32_t)(v < 0 ? -0.5 + v * (1 << PRECISION_BITS) : 0.5 + v * (1 << PRECISION_BITS));
      if (x < 64) h16[x] = (uint16_t)(int16_t)(0.5 + v * (1 << H_BITS)); /* bilinear weights are >= 0 */
    }
    for (int j = 0; j < c->npairs; j++) c->pairs[(size_t)xx * c->npairs + j] = h16[2 * j] | ((uint32_t)h16[2 * j + 1] << 16);
    c->bounds[xx * 2] = xmin;
    c->bounds[xx * 2 + 1] = xmax;
  }
  return DPT_OK;
}

static inline unsigned char dpt_clip8(int32_t v) {
  v >>= PRECISION_BITS;
  return (unsigned char)(v < 0 ? 0 : v > 255 ? 255 : v);
}

#if defined(__AVX2__)
#include <immintrin.h>
/* Bytes of two neighbouring RGB pixels, R0 G0 B0 R1 G1 B1, to int16 lanes R0 R1 G0 G1 B0 B1 0 0 (per
 * 128-bit lane): pmaddwd with a pair of weights then gives three channel sums of two taps. */
static inline __m256i dpt_pair_mask(void) {
  return _mm256_setr_epi8(0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1,
                          0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1);
}

/* Two RGB pixels at p of two rows (p and p + stride; 8-byte loads) as int16 pairs, row 0 low. */
static inline __m256i dpt_pairs2(const unsigned char *p, size_t stride, __m256i mask) {
  __m128i a = _mm_loadl_epi64((const __m128i *)p), b = _mm_loadl_epi64((const __m128i *)(p + stride));
  return _mm256_shuffle_epi8(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1), mask);
}

/* RGB rows y, y + 1 of the horizontal pass (see dpt_pass_h), two output pixels at a time. */
static void dpt_pass_h_rows2(const unsigned char *in, size_t stride, int x_base, const dpt_coeffs *h, int out_w,
                             int flip, unsigned char *out0, unsigned char *out1) {
  const __m256i mask = dpt_pair_mask(), half = _mm256_set1_epi32(1 << (H_BITS - 1));
  const int np = h->npairs;
  for (int xx = 0; xx < out_w; xx += 2) {
    int two = xx + 1 < out_w;
    int xb = two ? xx + 1 : xx;
    const uint32_t *ka = h->pairs + (size_t)xx * np, *kb = h->pairs + (size_t)xb * np;
    const unsigned char *pa = in + (size_t)(h->bounds[xx * 2] - x_base) * 3;
    const unsigned char *pb = in + (size_t)(h->bounds[xb * 2] - x_base) * 3;
    int n = h->bounds[xx * 2 + 1] > h->bounds[xb * 2 + 1] ? h->bounds[xx * 2 + 1] : h->bounds[xb * 2 + 1];
    __m256i acc_a = half, acc_b = half;
    for (int j = 0; 2 * j < n; j++) {
      acc_a = _mm256_add_epi32(acc_a, _mm256_madd_epi16(dpt_pairs2(pa + 6 * j, stride, mask),
                                                        _mm256_set1_epi32((int)ka[j])));
      acc_b = _mm256_add_epi32(acc_b, _mm256_madd_epi16(dpt_pairs2(pb + 6 * j, stride, mask),
                                                        _mm256_set1_epi32((int)kb[j])));
    }
    acc_a = _mm256_srai_epi32(acc_a, H_BITS);
    acc_b = _mm256_srai_epi32(acc_b, H_BITS);
    /* int32 -> uint8 with saturation (the clip to [0, 255]) */
    __m256i packed = _mm256_packus_epi16(_mm256_packs_epi32(acc_a, acc_b), _mm256_setzero_si256());
    uint8_t v[32];
    _mm256_storeu_si256((__m256i *)v, packed); /* row 0: a at 0..2, b at 4..6; row 1: a at 16.., b at 20.. */
    size_t oa = (size_t)(flip ? out_w - 1 - xx : xx) * 3, ob = (size_t)(flip ? out_w - 1 - xb : xb) * 3;
    memcpy(out0 + oa, v, 3);
    memcpy(out1 + oa, v + 16, 3);
    if (two) {
      memcpy(out0 + ob, v + 4, 3);
      memcpy(out1 + ob, v + 20, 3);
    }
  }
}
#endif

/* Horizontal pass: rows [0, rows) of src ([rows, src_w, C]; its column 0 is input pixel x_base) into
 * tmp [rows, out_w, C], mirrored if flip, with H_BITS weights (the same sums on every path, so the same
 * bytes with or without AVX2). src must have (ksize + 2) * C + 8 spare bytes at its end: pixels are read
 * in pairs of taps, the weights past an output's own taps being 0. */
static void dpt_pass_h(const unsigned char *src, int rows, int src_w, int x_base, int C, const dpt_coeffs *h,
                       int out_w, int flip, unsigned char *tmp) {
  int y = 0;
#if defined(__AVX2__)
  for (; C == 3 && y + 1 < rows; y += 2)
    dpt_pass_h_rows2(src + (size_t)y * src_w * 3, (size_t)src_w * 3, x_base, h, out_w, flip,
                     tmp + (size_t)y * out_w * 3, tmp + (size_t)(y + 1) * out_w * 3);
#endif
  for (; y < rows; y++) {
    const unsigned char *in = src + (size_t)y * src_w * C;
    unsigned char *out = tmp + (size_t)y * out_w * C;
    for (int xx = 0; xx < out_w; xx++) {
      const uint32_t *k = h->pairs + (size_t)xx * h->npairs;
      const unsigned char *p = in + (size_t)(h->bounds[xx * 2] - x_base) * C;
      int n = h->bounds[xx * 2 + 1];
      unsigned char *o = out + (size_t)(flip ? out_w - 1 - xx : xx) * C;
      for (int c = 0; c < C; c++) {
        int32_t acc = 1 << (H_BITS - 1);
        for (int x = 0; x < n; x++) acc += p[x * C + c] * (int32_t)(int16_t)(k[x / 2] >> (16 * (x % 2)));
        acc >>= H_BITS;
        o[c] = (unsigned char)(acc < 0 ? 0 : acc > 255 ? 255 : acc);
      }
    }
  }
}

/* Vertical pass: out row yy = sum over the taps of src rows ([*, row_len] bytes; src's row 0 is
 * input row y_base), summed a whole row at a time so that it vectorises (integer sums are exact
 * in any order, so the values are Pillow's). */
static void dpt_pass_rows(const unsigned char *src, int row_len, int y_base, const dpt_coeffs *v, int out_h,
                       int32_t *acc, unsigned char *dst) {
  const int32_t half = 1 << (PRECISION_BITS - 1);
  for (int yy = 0; yy < out_h; yy++) {
    const int32_t *k = v->k + (size_t)yy * v->ksize;
    const unsigned char *rows = src + (size_t)(v->bounds[yy * 2] - y_base) * row_len;
    int n = v->bounds[yy * 2 + 1];
    for (int i = 0; i < row_len; i++) acc[i] = half;
    for (int y = 0; y < n; y++) {
      const unsigned char *r = rows + (size_t)y * row_len;
      int32_t w = k[y];
      for (int i = 0; i < row_len; i++) acc[i] += r[i] * w;
    }
    unsigned char *o = dst + (size_t)yy * row_len;
    for (int i = 0; i < row_len; i++) o[i] = dpt_clip8(acc[i]);
  }
}

/* A source of pixels: a started JPEG decode or a raw CHW BGR record. fetch() writes the region
 * x0, y0, w x h as [h, w, C] RGB rows (mirrored if flip). */
typedef struct {
  struct jpeg_decompress_struct *cinfo; /* or NULL: raw */
  unsigned char *volatile *row;         /* the JPEG strip, freed by the caller */
  const unsigned char *raw;             /* [C, H, W] BGR */
  int width, height, C;
} dpt_pixels;

static void dpt_fetch(const dpt_pixels *px, int x0, int y0, int w, int h, int flip, unsigned char *out) {
  if (px->cinfo != NULL) {
    dpt_read_box(px->cinfo, x0, y0, w, h, flip, out, px->row);
    return;
  }
  int C = px->C;
  size_t plane = (size_t)px->width * px->height;
  for (int y = 0; y < h; y++) {
    const unsigned char *src = px->raw + (size_t)(y0 + y) * px->width + x0;
    for (int x = 0; x < w; x++) {
      int sx = flip ? w - 1 - x : x;
      unsigned char *dst = out + ((size_t)y * w + x) * C;
      for (int c = 0; c < C; c++) dst[c] = src[(size_t)(C - 1 - c) * plane + sx]; /* BGR -> RGB */
    }
  }
}

/* Render the box (in px's pixels) into dst [out_h, out_w, C]. On whole pixels: a plain copy when
 * the box has the output size, else the box alone resampled (crop, then resize: what torchvision's
 * resized_crop and render.py's torch path compute, to within a grey level). Off whole pixels:
 * Pillow's resize with the box as floats, whose filter also reads the pixels around the box. */
static int dpt_render_box(const dpt_pixels *px, const double box[4], int integral, int out_w, int out_h, int flip,
                          dpt_work *work, unsigned char *dst) {
  int C = px->C;
  int org_x = 0, org_y = 0, lim_w = px->width, lim_h = px->height;
  float fb[4] = {(float)box[0], (float)box[1], (float)box[2], (float)box[3]};
  if (integral) {
    org_x = (int)dpt_round(box[0]);
    org_y = (int)dpt_round(box[1]);
    lim_w = (int)dpt_round(box[2]) - org_x;
    lim_h = (int)dpt_round(box[3]) - org_y;
    if (lim_w == out_w && lim_h == out_h) {
      dpt_fetch(px, org_x, org_y, out_w, out_h, flip, dst);
      return DPT_OK;
    }
    fb[0] = fb[1] = 0.0f;
    fb[2] = (float)lim_w;
    fb[3] = (float)lim_h;
  }
  dpt_coeffs h, v;
  if (dpt_coeffs_make(&h, work, 0, lim_w, fb[0], fb[2], out_w) != DPT_OK ||
      dpt_coeffs_make(&v, work, 1, lim_h, fb[1], fb[3], out_h) != DPT_OK)
    return DPT_MEMORY;
  int rx0 = h.bounds[0], rx1 = h.bounds[(out_w - 1) * 2] + h.bounds[(out_w - 1) * 2 + 1];
  int ry0 = v.bounds[0], ry1 = v.bounds[(out_h - 1) * 2] + v.bounds[(out_h - 1) * 2 + 1];
  int rw = rx1 - rx0, rh = ry1 - ry0;
  if (rw <= 0 || rh <= 0) return DPT_GEOMETRY;
  /* region [rh, rw, C] -> horizontal pass [rh, out_w, C] (mirrored) -> vertical pass [out_h, out_w, C]:
   * Pillow's order of passes */
  unsigned char *region = (unsigned char *)dpt_grow(&work->region, (size_t)rw * rh * C + (size_t)(h.ksize + 2) * C + 8);
  unsigned char *tmp = (unsigned char *)dpt_grow(&work->tmp, (size_t)out_w * rh * C);
  int32_t *acc = (int32_t *)dpt_grow(&work->acc, (size_t)out_w * C * sizeof(int32_t));
  if (region == NULL || tmp == NULL || acc == NULL) return DPT_MEMORY;
  dpt_fetch(px, org_x + rx0, org_y + ry0, rw, rh, 0, region);
  dpt_pass_h(region, rh, rw, rx0, C, &h, out_w, flip, tmp);
  dpt_pass_rows(tmp, out_w * C, ry0, &v, out_h, acc, dst);
  return DPT_OK;
}

/* ---- 3. JPEG headers: what Pillow would do differently ---- */

/* The EXIF orientation in an APP1 "Exif" block: 1..8, 1 when the tag is absent, -1 when the block
 * cannot be read (Python then decides what it means). */
static int dpt_exif_orientation(const unsigned char *p, unsigned int len) {
  if (len < 14 || memcmp(p, "Exif\0\0", 6) != 0) return 1;
  const unsigned char *t = p + 6;
  unsigned int n = len - 6;
  int le = t[0] == 'I' && t[1] == 'I';
  if (!le && !(t[0] == 'M' && t[1] == 'M')) return -1;
#define U16(q) (le ? (unsigned)(q)[0] | ((unsigned)(q)[1] << 8) : ((unsigned)(q)[0] << 8) | (unsigned)(q)[1])
#define U32(q) (le ? U16(q) | (U16((q) + 2) << 16) : (U16(q) << 16) | U16((q) + 2))
  unsigned int ifd = U32(t + 4);
  if (ifd > n - 2 || ifd < 8) return -1;
  unsigned int count = U16(t + ifd);
  if (ifd + 2 + 12ULL * count > n) return -1;
  int found = 1, seen = 0;
  for (unsigned int i = 0; i < count; i++) {
    const unsigned char *e = t + ifd + 2 + 12 * i;
    if (U16(e) != 0x0112) continue;
    if (seen++ || U16(e + 2) != 3 || U32(e + 4) != 1) return -1;
    found = (int)U16(e + 8);
  }
  return found;
#undef U32
#undef U16
}

/* Whether Pillow would open this JPEG as a plain JPEG with no EXIF rotation (else: Python). */
static int dpt_plain_jpeg(const struct jpeg_decompress_struct *cinfo) {
  int exif_seen = 0;
  for (jpeg_saved_marker_ptr m = cinfo->marker_list; m != NULL; m = m->next) {
    if (m->marker == JPEG_APP0 + 1 && !exif_seen && m->data_length >= 6 && memcmp(m->data, "Exif\0\0", 6) == 0) {
      exif_seen = 1; /* Pillow keeps the first Exif block */
      if (dpt_exif_orientation(m->data, m->data_length) != 1) return 0;
    }
    if (m->marker == JPEG_APP0 + 2 && m->data_length >= 4 && memcmp(m->data, "MPF\0", 4) == 0) return 0;
  }
  return 1;
}

/* One encoded record: header, geometry, draft scale as Pillow's draft() picks it, decode, resample. */
static int dpt_render_jpeg(const dpt_chunk *c, const dpt_datum *d, dpt_sample *s, dpt_work *work,
                           unsigned char *dst, int32_t *window) {
  struct jpeg_decompress_struct cinfo;
  struct dpt_error jerr;
  char err[JMSG_LENGTH_MAX];
  unsigned char *volatile row = NULL; /* volatile: it is freed after a longjmp */

  if (d->data_len < 3 || d->data[0] != 0xFF || d->data[1] != 0xD8 || d->data[2] != 0xFF) return DPT_FORMAT;
  dpt_errors_to(&cinfo, &jerr, err, (int)sizeof(err));
  if (setjmp(jerr.jump)) {
    free(row);
    jpeg_destroy_decompress(&cinfo);
    return DPT_DECODE; /* libjpeg refused or warned */
  }
  jpeg_create_decompress(&cinfo);
  jpeg_save_markers(&cinfo, JPEG_APP0 + 1, 0xFFFF);
  jpeg_save_markers(&cinfo, JPEG_APP0 + 2, 0xFFFF);
  jpeg_mem_src(&cinfo, d->data, (unsigned long)d->data_len);
  jpeg_read_header(&cinfo, TRUE);
  int W = (int)cinfo.image_width, H = (int)cinfo.image_height, comps = cinfo.num_components;
  int colour = comps == 3 && (cinfo.jpeg_color_space == JCS_YCbCr || cinfo.jpeg_color_space == JCS_RGB);
  int grey = comps == 1 && cinfo.jpeg_color_space == JCS_GRAYSCALE;
  if (!(colour || grey) || !dpt_plain_jpeg(&cinfo) || (c->max_pixels && (int64_t)W * H > c->max_pixels)) {
    jpeg_destroy_decompress(&cinfo);
    return DPT_FORMAT;
  }
  s->box[0] = s->box[1] = 0.0;
  s->box[2] = W;
  s->box[3] = H;
  s->out_w = W;
  s->out_h = H;
  int rc = dpt_plan(s, c->stages, c->n_stages);
  if (rc != DPT_OK) {
    jpeg_destroy_decompress(&cinfo);
    return rc;
  }
  if (window != NULL) {
    window[0] = (int32_t)dpt_round(s->box[1]);
    window[1] = (int32_t)dpt_round(s->box[0]);
    window[2] = s->flip;
  }
  /* render.render_image: draft when the box shrinks 2x or more (Pillow's draft() picks the scale) */
  double factor = fmin((s->box[2] - s->box[0]) / (double)s->out_w, (s->box[3] - s->box[1]) / (double)s->out_h);
  int scale = 1, drafted = c->draft && factor >= 2;
  if (drafted) {
    int64_t tw = (int64_t)ceil(W / factor), th = (int64_t)ceil(H / factor);
    int64_t q = W / tw < H / th ? W / tw : H / th;
    scale = q >= 8 ? 8 : q >= 4 ? 4 : q >= 2 ? 2 : 1;
    double fx = ((double)W / scale) / W, fy = ((double)H / scale) / H;
    s->box[0] *= fx;
    s->box[1] *= fy;
    s->box[2] *= fx;
    s->box[3] *= fy;
  }
  int want_grey = c->channels == 1;
  if (want_grey && colour && !drafted) { /* Pillow converts with its own luma weights: Python */
    jpeg_destroy_decompress(&cinfo);
    return DPT_FORMAT;
  }
  cinfo.out_color_space = want_grey ? JCS_GRAYSCALE : JCS_RGB;
  cinfo.scale_num = 1;
  cinfo.scale_denom = (unsigned int)scale;
  cinfo.dct_method = JDCT_ISLOW;
  cinfo.do_fancy_upsampling = TRUE;
  jpeg_start_decompress(&cinfo);
  if (dpt_refusal(&cinfo) != NULL || cinfo.output_components != c->channels) {
    jpeg_destroy_decompress(&cinfo);
    return DPT_DECODE;
  }
  int integral = 1;
  for (int i = 0; i < 4; i++) integral &= fabs((double)dpt_round(s->box[i]) - s->box[i]) < 1e-6;
  dpt_pixels px = {&cinfo, &row, NULL, (int)cinfo.output_width, (int)cinfo.output_height, c->channels};
  rc = dpt_render_box(&px, s->box, integral, (int)s->out_w, (int)s->out_h, s->flip, work, dst);
  free(row);
  jpeg_destroy_decompress(&cinfo);
  return rc;
}

/* One raw record: [C, H, W] BGR bytes, C equal to the stream's channels. */
static int dpt_render_raw(const dpt_chunk *c, const dpt_datum *d, dpt_sample *s, dpt_work *work,
                          unsigned char *dst, int32_t *window) {
  int64_t C = d->channels, H = d->height, W = d->width;
  if (d->data_len == 0 || !(C == 1 || C == 3) || H <= 0 || W <= 0 || (uint64_t)(C * H * W) != d->data_len ||
      C != c->channels)
    return DPT_RAW;
  s->box[0] = s->box[1] = 0.0;
  s->box[2] = (double)W;
  s->box[3] = (double)H;
  s->out_w = W;
  s->out_h = H;
  int rc = dpt_plan(s, c->stages, c->n_stages);
  if (rc != DPT_OK) return rc;
  if (window != NULL) {
    window[0] = (int32_t)dpt_round(s->box[1]);
    window[1] = (int32_t)dpt_round(s->box[0]);
    window[2] = s->flip;
  }
  int integral = 1;
  for (int i = 0; i < 4; i++) integral &= fabs((double)dpt_round(s->box[i]) - s->box[i]) < 1e-6;
  dpt_pixels px = {NULL, NULL, d->data, (int)W, (int)H, (int)C};
  return dpt_render_box(&px, s->box, integral, (int)s->out_w, (int)s->out_h, s->flip, work, dst);
}

int dptrain_render_chunk(const dpt_chunk *c) {
  size_t sample_bytes = (size_t)c->out_h * c->out_w * c->channels;
  int left = 0;
  dpt_work work;
  memset(&work, 0, sizeof(work));
  for (int i = 0; i < c->n; i++) {
    dpt_datum d;
    int rc = dpt_parse_datum(c->values[i], c->lengths[i], &d);
    if (rc == DPT_OK && !(d.has_label && d.label >= 0 && d.label < c->num_classes)) rc = DPT_LABEL;
    if (rc == DPT_OK) {
      dpt_sample s;
      uint64_t key[4] = {c->seed, c->epochs[i], c->indices[i], 0};
      memset(&s, 0, sizeof(s));
      dpt_rng_init(&s.rng, key, 4);
      unsigned char *dst = c->images + (size_t)i * sample_bytes;
      int32_t *window = c->with_windows ? c->windows + (size_t)i * 3 : NULL;
      rc = d.encoded ? dpt_render_jpeg(c, &d, &s, &work, dst, window) : dpt_render_raw(c, &d, &s, &work, dst, window);
    }
    if (rc == DPT_OK) c->labels[i] = d.label;
    c->status[i] = (int8_t)rc;
    left += rc != DPT_OK;
  }
  dpt_work_free(&work);
  return left;
}

/* The geometry alone, for tests: plan sample i of the chunk on a W x H image; box[4], flip out. */
int dptrain_plan_sample(const dpt_chunk *c, int i, int W, int H, double *box, int *flip) {
  dpt_sample s;
  uint64_t key[4] = {c->seed, c->epochs[i], c->indices[i], 0};
  memset(&s, 0, sizeof(s));
  dpt_rng_init(&s.rng, key, 4);
  s.box[2] = W;
  s.box[3] = H;
  s.out_w = W;
  s.out_h = H;
  int rc = dpt_plan(&s, c->stages, c->n_stages);
  memcpy(box, s.box, sizeof(s.box));
  *flip = s.flip;
  return rc;
}
