// disk_iops.c — random O_DIRECT reads of one size at one depth (threads with a read in flight
// each) over a set of files; prints "reads seconds". Built and driven by bench/disk_iops.py.
//
//   disk_iops LEN DEPTH N_READS SEED FILE...
//
// Offsets are uniform over each file (a file drawn per read, weighted by its size), aligned to
// 4096 bytes, so that every read is a fresh one the drive has not just served.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_FILES 1024
#define MAX_DEPTH 512

static int n_files, fds[MAX_FILES];
static uint64_t sizes[MAX_FILES], total;
static size_t len;

typedef struct { uint64_t seed; int64_t n; int err; } job;

static void * worker(void * arg) {
    job * j = arg;
    void * buf = NULL;
    if (posix_memalign(&buf, 4096, len) != 0) { j->err = ENOMEM; return NULL; }
    uint64_t x = j->seed;
    for (int64_t i = 0; i < j->n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        uint64_t at = (x >> 11) % total;   // a byte of the whole set: its file, then an offset in it
        int f = 0;
        while (at >= sizes[f]) at -= sizes[f++];
        const uint64_t room = sizes[f] - len;
        const off_t off = (off_t) (((x >> 7) % (room + 1)) & ~(uint64_t) 4095);
        if (pread(fds[f], buf, len, off) < 0) { j->err = errno; break; }
    }
    free(buf);
    return NULL;
}

int main(int argc, char ** argv) {
    if (argc < 6) { fprintf(stderr, "usage: disk_iops LEN DEPTH N_READS SEED FILE...\n"); return 2; }
    len = (size_t) strtoull(argv[1], NULL, 10);
    const int depth = atoi(argv[2]);
    const int64_t n_reads = strtoll(argv[3], NULL, 10);
    const uint64_t seed = strtoull(argv[4], NULL, 10);
    if (len == 0 || len % 4096 || depth < 1 || depth > MAX_DEPTH || n_reads < depth) {
        fprintf(stderr, "disk_iops: LEN must be a positive multiple of 4096, DEPTH in [1, %d], N_READS >= DEPTH\n", MAX_DEPTH);
        return 2;
    }
    for (int i = 5; i < argc && n_files < MAX_FILES; i++) {
        struct stat st;
        const int fd = open(argv[i], O_RDONLY | O_DIRECT);
        if (fd < 0 && errno == EINVAL) {
            fprintf(stderr, "disk_iops: %s: this filesystem does not take O_DIRECT reads (the page cache would answer)\n", argv[i]);
            return 1;
        }
        if (fd < 0 || fstat(fd, &st) != 0) { fprintf(stderr, "disk_iops: %s: %s\n", argv[i], strerror(errno)); return 1; }
        if ((uint64_t) st.st_size < len) { close(fd); continue; }   // too small for one read
        fds[n_files] = fd;
        sizes[n_files++] = (uint64_t) st.st_size - len + 1;
        total += (uint64_t) st.st_size - len + 1;
    }
    if (n_files == 0) { fprintf(stderr, "disk_iops: no file holds a read of %zu bytes\n", len); return 1; }
    job jobs[MAX_DEPTH];
    pthread_t th[MAX_DEPTH];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < depth; i++) {
        jobs[i] = (job) { .seed = seed * 1000003u + (uint64_t) i * 7919u + 1, .n = n_reads / depth + (i < n_reads % depth) };
        if (pthread_create(&th[i], NULL, worker, &jobs[i]) != 0) { fprintf(stderr, "disk_iops: cannot start a thread\n"); return 1; }
    }
    for (int i = 0; i < depth; i++) pthread_join(th[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    for (int i = 0; i < depth; i++)
        if (jobs[i].err) { fprintf(stderr, "disk_iops: read failed: %s\n", strerror(jobs[i].err)); return 1; }
    printf("%lld %.9f\n", (long long) n_reads, (double) (t1.tv_sec - t0.tv_sec) + 1e-9 * (double) (t1.tv_nsec - t0.tv_nsec));
    return 0;
}
