// memory_read.c — the plain memory-read speed the FFN kernels are compared with: BYTES bytes of
// RAM read by THREADS threads with AVX2 loads (each thread a contiguous share of whole 64-byte
// lines, as the dense op streams its share of a layer), ROUNDS times. Built and driven by
// bench/memory_read.py.
//
//   memory_read BYTES THREADS ROUNDS
//
// The buffer is written first (every page in RAM). Each round xor-folds every 64-bit word; the
// fold is checked against a scalar one before anything is printed (it read every byte), then
// one line: "fold seconds_1 ... seconds_ROUNDS".
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define MAX_THREADS 64

typedef struct { const uint8_t * p; size_t n; uint64_t fold; } share;

static void * read_share(void * v) {
    share * a = v;
    __m256i s0 = _mm256_setzero_si256(), s1 = s0;
    for (size_t i = 0; i + 64 <= a->n; i += 64) {
        s0 = _mm256_xor_si256(s0, _mm256_loadu_si256((const __m256i *) (a->p + i)));
        s1 = _mm256_xor_si256(s1, _mm256_loadu_si256((const __m256i *) (a->p + i + 32)));
    }
    s0 = _mm256_xor_si256(s0, s1);
    a->fold = (uint64_t) _mm256_extract_epi64(s0, 0) ^ (uint64_t) _mm256_extract_epi64(s0, 1) ^
              (uint64_t) _mm256_extract_epi64(s0, 2) ^ (uint64_t) _mm256_extract_epi64(s0, 3);
    return NULL;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

// One round: every thread folds its share; returns the fold of the whole buffer (0 if a thread
// could not be started).
static uint64_t read_all(const uint8_t * p, size_t n, int n_threads) {
    share s[MAX_THREADS];
    pthread_t th[MAX_THREADS];
    const size_t lines = n / 64;
    for (int i = 0; i < n_threads; i++) {
        const size_t lo = lines * (size_t) i / (size_t) n_threads, hi = lines * (size_t) (i + 1) / (size_t) n_threads;
        s[i] = (share) { p + 64 * lo, 64 * (hi - lo), 0 };
    }
    int started = 1;
    for (int i = 1; i < n_threads; i++, started++)
        if (pthread_create(&th[i], NULL, read_share, &s[i]) != 0) break;
    read_share(&s[0]);
    uint64_t f = s[0].fold;
    for (int i = 1; i < started; i++) { pthread_join(th[i], NULL); f ^= s[i].fold; }
    return started == n_threads ? f : 0;
}

int main(int argc, char ** argv) {
    if (argc != 4) { fprintf(stderr, "usage: memory_read BYTES THREADS ROUNDS\n"); return 2; }
    const size_t n = (size_t) strtoull(argv[1], NULL, 10);
    const int n_threads = atoi(argv[2]), rounds = atoi(argv[3]);
    if (n < 64 || n % 64 || n_threads < 1 || n_threads > MAX_THREADS || rounds < 1) {
        fprintf(stderr, "BYTES must be a positive multiple of 64, THREADS 1..%d, ROUNDS >= 1\n", MAX_THREADS);
        return 2;
    }
    uint64_t * buf = NULL;
    if (posix_memalign((void **) &buf, 64, n) != 0) { fprintf(stderr, "cannot allocate %zu bytes\n", n); return 1; }
    uint64_t x = 0x9E3779B97F4A7C15ull, want = 0;
    for (size_t i = 0; i < n / 8; i++) {   // written (every page present), and the scalar fold
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        buf[i] = x;
        want ^= x;
    }
    double * t = malloc(sizeof(double) * (size_t) rounds);
    if (!t) { fprintf(stderr, "out of memory\n"); return 1; }
    for (int r = 0; r < rounds; r++) {
        const double t0 = now_s();
        const uint64_t got = read_all((const uint8_t *) buf, n, n_threads);
        t[r] = now_s() - t0;
        if (got != want) {
            fprintf(stderr, "round %d: fold %016llx, want %016llx (a share was not read whole)\n", r,
                    (unsigned long long) got, (unsigned long long) want);
            return 1;
        }
    }
    printf("%016llx", (unsigned long long) want);
    for (int r = 0; r < rounds; r++) printf(" %.9f", t[r]);
    printf("\n");
    free(t);
    free(buf);
    return 0;
}
