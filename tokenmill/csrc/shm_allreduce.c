/* Sum of a float32 buffer over the tensor-parallel ranks of one node, through a shared memory
 * segment every rank maps (distributed/shm_allreduce.py lays it out):
 *
 *   header: one 64-byte line per rank holding the last sequence number it published, then one
 *           line with the abort word;
 *   slots:  2 (sequence parity) x ranks x slot_floats floats.
 *
 * Each call cuts the buffer into slot-sized chunks. Per chunk a rank copies its part into its
 * own slot, publishes the chunk's sequence number (release), waits until every rank has
 * published it (acquire), then sums the slots in rank order into its buffer: every rank adds
 * the same numbers in the same order, so all ranks hold the same bits, run after run. Slots
 * alternate by parity: a rank writes parity p again only at sequence s + 2, after every rank
 * arrived at s + 1, which each did only after reading its sequence-s sums.
 *
 * Waiting spins (a pause per turn, yielding the CPU after a while) and checks the abort word,
 * which the Python side sets when a rank died: the call then returns -1 instead of waiting
 * forever. */
#include <immintrin.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

#define TM_LINE 64

static inline volatile int64_t *published(char *base, int64_t rank) {
    return (volatile int64_t *)(base + rank * TM_LINE);
}

static int wait_all(char *base, int64_t size, int64_t seq) {
    volatile int64_t *abort_word = published(base, size);
    for (int64_t r = 0; r < size; r++) {
        int64_t spins = 0;
        while (__atomic_load_n(published(base, r), __ATOMIC_ACQUIRE) < seq) {
            if (++spins < 2048) {
                _mm_pause();
                continue;
            }
            if (__atomic_load_n(abort_word, __ATOMIC_ACQUIRE))
                return -1;
            sched_yield();
        }
    }
    return 0;
}

int64_t tm_shm_allreduce(char *base, int64_t rank, int64_t size, int64_t slot_floats,
                         int64_t *seq, float *x, int64_t n) {
    float *slots = (float *)(base + (size + 1) * TM_LINE);
    for (int64_t off = 0; off < n; off += slot_floats) {
        int64_t m = n - off < slot_floats ? n - off : slot_floats;
        int64_t s = ++*seq;
        float *set = slots + (s & 1) * size * slot_floats;
        memcpy(set + rank * slot_floats, x + off, m * sizeof(float));
        __atomic_store_n(published(base, rank), s, __ATOMIC_RELEASE);
        if (wait_all(base, size, s))
            return -1;
        float *out = x + off;
        const float *first = set;
        for (int64_t i = 0; i < m; i++)
            out[i] = first[i];
        for (int64_t r = 1; r < size; r++) {
            const float *part = set + r * slot_floats;
            for (int64_t i = 0; i < m; i++)
                out[i] += part[i];
        }
    }
    return 0;
}
