/* Paged decode attention for float32 on the CPU: one query token per sequence, K/V read in place from the block
 * pool (no gather), each K/V row shared by the query heads of its GQA group.
 *
 * Layouts: q and out rows are [Hq, D] at rows[s] * stride; the caches are [num_blocks, block_size, Hkv, D]
 * contiguous; tables is [S, table_stride] int32; lens[s] >= 1 is the context length of sequence s.
 * Per sequence and head: p = softmax(q . K^T * scale) over the context (its last `window` keys when window > 0:
 * a sliding window), out = p . V. With softcap > 0 each score becomes softcap * tanh(score / softcap) (Gemma 2).
 * Sequences are spread over an OpenMP team. Built with -fopenmp, the library needs libgomp.so.1, which the dynamic
 * loader resolves to the copy torch already loaded: the kernel shares torch's thread pool instead of fighting it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static void attend(const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int len,
                   int window, int q_heads, int kv_heads, int head_dim, int block_size, float scale, float softcap,
                   float *out, float *scores, int max_len) {
    const int group = q_heads / kv_heads, row = kv_heads * head_dim;
    const int first = window > 0 && len > window ? len - window : 0, n = len - first;
    for (int t = first; t < len; t++) {
        const float *k = k_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row;
        for (int h = 0; h < q_heads; h++) {
            const float *qh = q + h * head_dim, *kh = k + (h / group) * head_dim;
            float dot = 0.0f;
            for (int i = 0; i < head_dim; i++) dot += qh[i] * kh[i];
            const float score = dot * scale;
            scores[h * max_len + t - first] = softcap > 0.0f ? softcap * tanhf(score / softcap) : score;
        }
    }
    for (int h = 0; h < q_heads; h++) {
        float *s = scores + h * max_len, top = s[0], sum = 0.0f;
        for (int t = 1; t < n; t++) top = s[t] > top ? s[t] : top;
        for (int t = 0; t < n; t++) sum += (s[t] = expf(s[t] - top));
        const float inv = 1.0f / sum;
        for (int t = 0; t < n; t++) s[t] *= inv;
        for (int i = 0; i < head_dim; i++) out[h * head_dim + i] = 0.0f;
    }
    for (int t = first; t < len; t++) {
        const float *v = v_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row;
        for (int h = 0; h < q_heads; h++) {
            const float p = scores[h * max_len + t - first], *vh = v + (h / group) * head_dim;
            float *oh = out + h * head_dim;
            for (int i = 0; i < head_dim; i++) oh[i] += p * vh[i];
        }
    }
}

/* Returns 0, or 1 when a thread could not allocate its scores (q_heads * max_len floats). */
int paged_decode_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                               const int32_t *tables, int64_t table_stride, const int32_t *lens, const int64_t *rows,
                               int num_seqs, int q_heads, int kv_heads, int head_dim, int block_size, int max_len,
                               float scale, float *out, int64_t out_stride, int num_threads, int window,
                               float softcap) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(|| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)q_heads * (size_t)max_len);
        failed = scores == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int s = 0; s < num_seqs; s++) /* every thread takes part in the loop, even one without scores */
            if (scores != NULL)
                attend(q + rows[s] * q_stride, k_cache, v_cache, tables + (int64_t)s * table_stride, lens[s], window,
                       q_heads, kv_heads, head_dim, block_size, scale, softcap, out + rows[s] * out_stride, scores,
                       max_len);
        free(scores);
    }
    return failed;
}
