/* GPT-2's feed-forward network in plain C, judged by gpt2ffn's golden tensors.

   It reads block L's FFN input (ln_2's output) and weights from a golden set written as raw float32 files,
   computes c_fc -> GELU -> c_proj, and writes each stage under its golden name for `gpt2ffn verify`:

     gpt2ffn extract --model random:gpt2:0 --ids 15496,11,616,3290 --out golden --format bin
     cc -O2 -o ffn examples/ffn.c -lm
     ./ffn golden out 0
     gpt2ffn verify --golden golden --candidate out

   Shapes come from the file sizes: d from c_proj's bias, the hidden width from c_fc's bias, T from ln_2.
   Weights are HF's Conv1D layout, [in, out], so y = x @ w + b reads w row by row.
   `./ffn golden out 0 --exact-gelu` uses the erf GELU instead, to see the judge name that mistake. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static float *read_floats(const char *dir, const char *name, long *n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.bin", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "error: cannot open %s (write the golden set with: gpt2ffn extract ... --format bin)\n", path);
        exit(2);
    }
    fseek(f, 0, SEEK_END);
    long bytes = ftell(f);
    fseek(f, 0, SEEK_SET);
    float *data = malloc(bytes);
    if (!data || fread(data, 1, bytes, f) != (size_t)bytes) {
        fprintf(stderr, "error: cannot read %s\n", path);
        exit(2);
    }
    fclose(f);
    *n = bytes / (long)sizeof(float);
    return data;
}

static void write_floats(const char *dir, const char *name, const float *data, long n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.bin", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, sizeof(float), n, f) != (size_t)n) {
        fprintf(stderr, "error: cannot write %s\n", path);
        exit(2);
    }
    fclose(f);
}

/* y[t, :] = x[t, :] @ w + b, w is [in, out] (HF Conv1D) */
static void linear(float *y, const float *x, const float *w, const float *b, long T, long in, long out) {
    for (long t = 0; t < T; t++) {
        float *yt = y + t * out;
        memcpy(yt, b, out * sizeof(float));
        for (long i = 0; i < in; i++) {
            float xi = x[t * in + i];
            const float *wi = w + i * out;
            for (long j = 0; j < out; j++) yt[j] += xi * wi[j];
        }
    }
}

/* GPT-2's GELU is the tanh form (HF gelu_new) */
static float gelu_tanh(float x) {
    const float s = 0.7978845608028654f; /* sqrt(2/pi) */
    return 0.5f * x * (1.0f + tanhf(s * (x + 0.044715f * x * x * x)));
}

static float gelu_erf(float x) { return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f)); }

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s GOLDEN_DIR OUT_DIR LAYER [--exact-gelu]\n", argv[0]);
        return 2;
    }
    const char *golden = argv[1], *out = argv[2];
    int layer = atoi(argv[3]);
    int exact = argc > 4 && strcmp(argv[4], "--exact-gelu") == 0;
    char name[256];
#define READ(var, stage, n) (snprintf(name, sizeof name, "h%d_%s", layer, stage), var = read_floats(golden, name, n))
    long n_x, n_wfc, n_bfc, n_wproj, n_bproj;
    float *x, *w_fc, *b_fc, *w_proj, *b_proj;
    READ(x, "ln_2", &n_x);
    READ(w_fc, "c_fc_weight", &n_wfc);
    READ(b_fc, "c_fc_bias", &n_bfc);
    READ(w_proj, "ffn_c_proj_weight", &n_wproj);
    READ(b_proj, "ffn_c_proj_bias", &n_bproj);
    long d = n_bproj, hidden = n_bfc, T = n_x / d;
    if (n_wfc != d * hidden || n_wproj != hidden * d || n_x != T * d) {
        fprintf(stderr, "error: sizes disagree: d %ld, hidden %ld, ln_2 %ld values\n", d, hidden, n_x);
        return 2;
    }
    float *h = malloc(T * hidden * sizeof(float)), *a = malloc(T * hidden * sizeof(float));
    float *y = malloc(T * d * sizeof(float));
    linear(h, x, w_fc, b_fc, T, d, hidden);
    for (long i = 0; i < T * hidden; i++) a[i] = exact ? gelu_erf(h[i]) : gelu_tanh(h[i]);
    linear(y, a, w_proj, b_proj, T, hidden, d);
#define WRITE(stage, data, n) (snprintf(name, sizeof name, "h%d_%s", layer, stage), write_floats(out, name, data, n))
    WRITE("c_fc", h, T * hidden);
    WRITE("gelu", a, T * hidden);
    WRITE("ffn", y, T * d);
    printf("block %d FFN: %ld tokens, %ld -> %ld -> %ld, %s GELU, written to %s\n", layer, T, d, hidden, d,
           exact ? "exact (erf)" : "tanh", out);
    return 0;
}
