/* The token-epoch writer in C: ring slots -> committed epochs, with the GIL released.
 *
 * Graph decode (integrations/graph_decode.py) has the GPU write each token's epoch payload into a slot of a ring
 * of host memory (cuda/graphs.py: a 4096-byte slot header whose word 0, seq + 1, is written last, then the KV
 * pages the token's row covers). This writer turns those slots into log epochs, byte for byte what
 * ``RecoveryLog.append`` writes for the same deltas and metadata (core/epochs.py's layout; tests/test_slotlog.py
 * compares the two), on a thread that never holds the GIL while it works: the decode thread never waits for
 * it to get the interpreter back.
 *
 * Division of labour:
 * - the decode thread calls ``submit(seq, n_tokens, n_new, done)`` (GIL held, a few stores) after it read the
 *   token of step ``seq`` from its slot, and ``wait(seq)`` (GIL released) for the durability contract;
 * - the writer thread (a Python thread) calls ``run()``, which releases the GIL and returns only when it needs
 *   Python: the epoch does not fit the active segment (1: the caller rolls, under the log's mutex, and calls
 *   ``set_target`` and ``run`` again), a failure (2: ``error``), or ``stop()`` with the queue drained (0);
 * - everything else (the epoch layout, CRC32C, the stores, fdatasync per the fsync policy) happens in ``run``.
 *
 * Crash safety, the same order as core/mapped.py: into a mapped (tmpfs, MAP_SHARED) segment the payloads are
 * stored first, then the header and descriptors, then the commit marker, with a fence between the phases; into
 * a file segment the epoch is one pwritev (commit marker last in it), then fdatasync under ``always``. Replay
 * decides what committed from the bytes alone (a zero header or a zero marker is a torn tail).
 *
 * The metadata JSON is a template made by Python (``encode_json`` of the session's metadata with sentinel
 * numbers, split at them): literal chunks with holes between them for n_tokens, n_new, done, a cache length and
 * the time. CRC32C (Castagnoli) uses the SSE4.2 crc32 instruction where the CPU has it, a slicing-by-8 table
 * otherwise.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdarg.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "_crc32c.h"

/* ------------------------------------------------------------------------------------------------ format */
/* core/format.py: ALIGN, the epoch header, record entries, the commit marker (little-endian everywhere). */
#define ALIGN 4096ull
#define EPOCH_HEADER_BYTES 56
#define ENTRY_BYTES 48
#define COMMIT_BYTES 32
#define REC_PAGES 2
#define REC_RUNS 3
#define REC_META 4
#define FORMAT_VERSION 1
#define MAX_RECORDS 8 /* token epochs use 3; a step epoch (StepWriter) up to 8 */
#define MAX_NAME 200

static inline uint64_t align_up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }
static inline void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the log format is little-endian; this writer stores native words"
#endif

enum { HOLE_N_TOKENS = 0, HOLE_N_NEW = 1, HOLE_DONE = 2, HOLE_LENGTH = 3, HOLE_TIME = 4, N_HOLE_KINDS = 5 };
enum { TARGET_NONE = 0, TARGET_MAPPED = 1, TARGET_FILE = 2 };
enum { FSYNC_NEVER = 0, FSYNC_ALWAYS = 1, FSYNC_INTERVAL = 2 };
enum { RUN_STOPPED = 0, RUN_ROLL = 1, RUN_FAILED = 2 };
/* error kinds (``error`` tuple's first item): what the Python side must do about it */
enum { ERR_NONE = 0, ERR_SLOT = 1, ERR_WRITE = 2, ERR_SYNC = 3 };

typedef struct {
    int64_t seq, n_tokens, n_new, done, submit_ns;
    uint8_t *blob; /* StepWriter: the epoch's records (owned; freed once written) */
    size_t blob_len;
} Item;

typedef struct {
    int64_t seq, submit_ns, start_ns, commit_ns, total_bytes, epoch;
} Stat;

#define MAX_HELPERS 15
#define MAX_PIECES 64
typedef struct Piece {
    const uint8_t *src;
    uint8_t *dst; /* NULL: checksum only */
    uint64_t len;
    uint32_t crc;
} Piece;

typedef struct {
    PyObject_HEAD
    int generic; /* a StepWriter: items carry their records (blob), no ring */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int sync_ready;
    /* the ring (read only) */
    const uint8_t *ring;
    uint64_t n_slots, slot_bytes, slot_header, max_pages, kv_pb;
    uint8_t kv_name[MAX_NAME];
    size_t kv_name_len;
    /* the writer's own image of the tokens region (written: token ids; read: the epoch's page) */
    uint8_t *tok;
    uint64_t tok_nbytes, tok_pb;
    uint8_t tok_name[MAX_NAME];
    size_t tok_name_len;
    /* the metadata template: n_chunks = n_holes + 1 */
    uint8_t *chunks;
    size_t *chunk_off, *chunk_len;
    int *holes;
    int n_holes;
    size_t chunks_total;
    /* the queue of submitted steps (decode thread -> writer) */
    Item *q;
    uint64_t q_cap, q_head, q_tail;
    /* progress (guarded by mu; committed also read without it) */
    int64_t committed;   /* highest seq whose epoch committed (-1: none) */
    int64_t last_seq;    /* StepWriter: the last seq submitted (-1: none) */
    int64_t committed_epoch; /* its epoch number (0: none yet) */
    int stop_req, failed, rolling, running;
    int roll_req;        /* roll before the next epoch (a compactor wants the segment sealed): set_target clears it */
    /* the target segment */
    int kind, fd, fsync_mode;
    uint8_t *base;
    uint64_t end, cap, soft_max, synced_end;
    int64_t seg_epochs, next_epoch, durable_epoch, epochs, bytes_written;
    int64_t interval_ns, last_sync_ns;
    uint64_t last_total;
    uint64_t need; /* RUN_ROLL: bytes the pending epoch needs */
    /* failure */
    int err_kind, err_errno;
    uint64_t err_start;
    int64_t err_epoch;
    char err_text[512];
    /* scratch */
    uint8_t *head;
    size_t head_cap;
    uint8_t *meta;
    size_t meta_cap;
    Stat *stats;
    size_t n_stats, stats_cap;
    uint8_t zeros[ALIGN];
    /* StepWriter: helper threads that copy + checksum pieces of a large payload (the writer thread takes pieces
     * too); their CRCs are combined (gf2_multmodp by x^(8 len)) */
    int n_helpers, pool_ready, pool_quit;
    uint64_t par_min;
    uint64_t fuse; /* copy + CRC in chunks of this many bytes (0: copy a whole piece, then checksum it) */
    pthread_t helpers[MAX_HELPERS];
    pthread_mutex_t pm;
    pthread_cond_t pcv, dcv;
    struct Piece *pieces;
    int n_pieces, next_piece, done_pieces;
} Writer;

static int64_t now_ns(clockid_t clk) {
    struct timespec ts;
    clock_gettime(clk, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static int set_error(Writer *w, int kind, int errnum, uint64_t start, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int set_error(Writer *w, int kind, int errnum, uint64_t start, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->err_text, sizeof w->err_text, fmt, ap);
    va_end(ap);
    w->err_kind = kind;
    w->err_errno = errnum;
    w->err_start = start;
    w->err_epoch = w->next_epoch;
    return -1;
}

/* metadata of one token into w->meta; returns its length */
static size_t build_meta(Writer *w, const Item *it, int64_t length) {
    size_t n = 0;
    double t = (double)now_ns(CLOCK_REALTIME) / 1e9;
    for (int i = 0; i <= w->n_holes; i++) {
        memcpy(w->meta + n, w->chunks + w->chunk_off[i], w->chunk_len[i]);
        n += w->chunk_len[i];
        if (i == w->n_holes) break;
        char num[48];
        int k;
        switch (w->holes[i]) {
        case HOLE_N_TOKENS: k = snprintf(num, sizeof num, "%lld", (long long)it->n_tokens); break;
        case HOLE_N_NEW: k = snprintf(num, sizeof num, "%lld", (long long)it->n_new); break;
        case HOLE_DONE: k = snprintf(num, sizeof num, "%s", it->done ? "true" : "false"); break;
        case HOLE_LENGTH: k = snprintf(num, sizeof num, "%lld", (long long)length); break;
        default: k = snprintf(num, sizeof num, "%.6f", t); break;
        }
        memcpy(w->meta + n, num, (size_t)k);
        n += (size_t)k;
    }
    return n;
}

typedef struct {
    int rtype;
    const uint8_t *name;
    size_t name_len;
    int64_t var_words[2]; /* PAGES of one page: [page]; RUNS: [start, length] */
    const uint8_t *var; /* the record's variable part after its name (var_words, the META JSON, a blob's) */
    size_t var_len;
    uint64_t count;
    const uint8_t *payload;
    uint64_t plen, off;
    uint32_t crc;
    int placed; /* the payload is in the mapping already (par_crc_copy) */
} Rec;

static void pages_rec(Rec *r, const uint8_t *name, size_t name_len, int64_t first, int64_t n, const uint8_t *payload,
                      uint64_t pb) {
    /* core/epochs.py _records: contiguous pages are one run; one page is a PAGES record, more a RUNS record */
    memset(r, 0, sizeof *r);
    r->name = name;
    r->name_len = name_len;
    r->payload = payload;
    r->plen = (uint64_t)n * pb;
    if (n == 1) {
        r->rtype = REC_PAGES;
        r->var_words[0] = first;
        r->var_len = 8;
        r->count = 1;
    } else {
        r->rtype = REC_RUNS;
        r->var_words[0] = first;
        r->var_words[1] = n;
        r->var_len = 16;
        r->count = 1;
    }
    r->var = (const uint8_t *)r->var_words;
}

static size_t rec_var_len(const Rec *r) { return r->var_len; }

static int store_epoch(Writer *w, Rec *recs, int nr);

/* One epoch: 0 written, 1 needs a new segment (w->need), -1 failed (w->err_*). Called without mu. */
static int write_one(Writer *w, const Item *it) {
    const uint8_t *slot = w->ring + (uint64_t)(it->seq % (int64_t)w->n_slots) * w->slot_bytes;
    const volatile int64_t *words = (const volatile int64_t *)slot;
    int64_t sw = __atomic_load_n((const int64_t *)&words[0], __ATOMIC_ACQUIRE);
    if (sw != it->seq + 1)
        return set_error(w, ERR_SLOT, 0, w->end, "ring slot of step %lld does not hold it (sequence word %lld)",
                         (long long)it->seq, (long long)sw);
    int64_t token = words[1], row = words[2], page0 = words[3], npages = words[4];
    if (npages < 0 || (uint64_t)npages > w->max_pages || page0 < 0 || row < 0)
        return set_error(w, ERR_SLOT, 0, w->end, "ring slot of step %lld has a bad header (row %lld, pages %lld+%lld)",
                         (long long)it->seq, (long long)row, (long long)page0, (long long)npages);
    int64_t idx = it->n_tokens - 1;
    if (idx < 0 || (uint64_t)(idx + 1) * 8 > w->tok_nbytes)
        return set_error(w, ERR_SLOT, 0, w->end, "token %lld is outside the tokens region (%llu bytes)",
                         (long long)idx, (unsigned long long)w->tok_nbytes);
    memcpy(w->tok + idx * 8, &token, 8);
    int64_t t0 = idx * 8 / (int64_t)w->tok_pb, t1 = (it->n_tokens * 8 + (int64_t)w->tok_pb - 1) / (int64_t)w->tok_pb;

    Rec recs[MAX_RECORDS];
    int nr = 0;
    if (npages > 0) pages_rec(&recs[nr++], w->kv_name, w->kv_name_len, page0, npages, slot + w->slot_header, w->kv_pb);
    pages_rec(&recs[nr++], w->tok_name, w->tok_name_len, t0, t1 - t0, w->tok + t0 * w->tok_pb, w->tok_pb);
    Rec *m = &recs[nr++];
    memset(m, 0, sizeof *m);
    m->rtype = REC_META;
    m->name = (const uint8_t *)"";
    m->var = w->meta;
    m->var_len = build_meta(w, it, row + 1);
    m->count = m->var_len;
    return store_epoch(w, recs, nr);
}

/* A step epoch (StepWriter): the blob is u32 n_records, u32 0, then per record a 40-byte entry (u16 type, u16 0,
 * u32 name_len, u64 count, u64 var_len, u64 payload address, u64 payload bytes), its name and its variable part,
 * padded to 8. Payloads are host addresses the submitter keeps valid (and unchanged) until the epoch commits. */
static int write_blob(Writer *w, const Item *it) {
    const uint8_t *b = it->blob, *end = it->blob + it->blob_len;
    uint32_t n;
    if (it->blob_len < 8) return set_error(w, ERR_SLOT, 0, w->end, "step %lld: records blob too short", (long long)it->seq);
    memcpy(&n, b, 4);
    if (n == 0 || n > MAX_RECORDS)
        return set_error(w, ERR_SLOT, 0, w->end, "step %lld: %u records (1 to %d)", (long long)it->seq, n, MAX_RECORDS);
    b += 8;
    Rec recs[MAX_RECORDS];
    for (uint32_t i = 0; i < n; i++) {
        Rec *r = &recs[i];
        memset(r, 0, sizeof *r);
        if (end - b < 40) return set_error(w, ERR_SLOT, 0, w->end, "step %lld: record %u cut short", (long long)it->seq, i);
        uint16_t rt;
        uint32_t nl;
        uint64_t cnt, vl, pa, pl;
        memcpy(&rt, b, 2); memcpy(&nl, b + 4, 4); memcpy(&cnt, b + 8, 8); memcpy(&vl, b + 16, 8);
        memcpy(&pa, b + 24, 8); memcpy(&pl, b + 32, 8);
        b += 40;
        if ((rt != REC_PAGES && rt != REC_RUNS && rt != REC_META) || nl >= MAX_NAME || vl > (uint64_t)(end - b) ||
            nl > (uint64_t)(end - b) - vl || (rt != REC_META && (!pa || !pl)) || (rt == REC_META && (pa || pl)))
            return set_error(w, ERR_SLOT, 0, w->end, "step %lld: record %u is malformed (type %u)", (long long)it->seq, i,
                             (unsigned)rt);
        r->rtype = rt;
        r->name = b;
        r->name_len = nl;
        r->var = b + nl;
        r->var_len = (size_t)vl;
        r->count = rt == REC_META ? vl : cnt;
        r->payload = (const uint8_t *)(uintptr_t)pa;
        r->plen = pl;
        uint64_t adv = align_up(nl + vl, 8);
        b += adv <= (uint64_t)(end - b) ? adv : nl + vl;
    }
    return store_epoch(w, recs, (int)n);
}

/* One piece: its CRC32C, and its copy to dst unless NULL. Fused (fuse > 0): in chunks of ``fuse`` bytes, each
 * copied then checksummed from the destination while it is still in the core's cache, so DRAM is read once
 * (the source) and written once instead of the destination being read back after the whole piece was copied
 * (a prefill's epoch is hundreds of MB: the unfused copy + CRC read the bytes twice from DRAM). */
static uint32_t piece_crc_copy(const uint8_t *src, uint8_t *dst, uint64_t len, uint64_t fuse) {
    if (!dst) return crc32c(0, src, len);
    if (!fuse) {
        memcpy(dst, src, len);
        return crc32c(0, dst, len);
    }
    uint32_t c = 0;
    for (uint64_t o = 0; o < len; o += fuse) {
        uint64_t n = len - o < fuse ? len - o : fuse;
        memcpy(dst + o, src + o, n);
        c = crc32c(c, dst + o, n);
    }
    return c;
}

/* the helpers: take pieces until none is left (the writer thread runs the same loop) */
static void run_pieces(Writer *w) {
    for (;;) {
        pthread_mutex_lock(&w->pm);
        if (w->next_piece >= w->n_pieces) { pthread_mutex_unlock(&w->pm); return; }
        Piece *pc = &w->pieces[w->next_piece++];
        pthread_mutex_unlock(&w->pm);
        pc->crc = piece_crc_copy(pc->src, pc->dst, pc->len, w->fuse);
        pthread_mutex_lock(&w->pm);
        if (++w->done_pieces == w->n_pieces) pthread_cond_broadcast(&w->dcv);
        pthread_mutex_unlock(&w->pm);
    }
}

static void *helper_main(void *arg) {
    Writer *w = (Writer *)arg;
    pthread_mutex_lock(&w->pm);
    for (;;) {
        while (!w->pool_quit && w->next_piece >= w->n_pieces) pthread_cond_wait(&w->pcv, &w->pm);
        if (w->pool_quit) break;
        pthread_mutex_unlock(&w->pm);
        run_pieces(w);
        pthread_mutex_lock(&w->pm);
    }
    pthread_mutex_unlock(&w->pm);
    return NULL;
}

/* CRC32C of src[0, len) (and a copy to dst unless NULL), cut into pieces shared with the helpers. Fused: up to
 * PIECES_PER_THREAD pieces a thread (of at least MIN_PIECE bytes), taken in turn, so a thread the decode thread
 * or the driver preempts holds up one small piece, not a whole share; unfused (the layout before): one piece a
 * thread. The pieces' CRCs are combined in order (x^(8 len) mod P, then a multiply: microseconds a piece). */
#define PIECES_PER_THREAD 4
#define MIN_PIECE (4ull << 20)
static uint32_t par_crc_copy(Writer *w, const uint8_t *src, uint8_t *dst, uint64_t len) {
    uint64_t k = (uint64_t)w->n_helpers + 1;
    if (w->fuse) {
        uint64_t want = k * PIECES_PER_THREAD, most = (len + MIN_PIECE - 1) / MIN_PIECE;
        k = want < most ? want : most;
        if (k < (uint64_t)w->n_helpers + 1) k = (uint64_t)w->n_helpers + 1;
    }
    uint64_t piece = align_up((len + k - 1) / k, ALIGN);
    int n = (int)((len + piece - 1) / piece);
    if (n > MAX_PIECES) { piece = align_up((len + MAX_PIECES - 1) / MAX_PIECES, ALIGN); n = (int)((len + piece - 1) / piece); }
    Piece pcs[MAX_PIECES];
    for (int i = 0; i < n; i++) {
        uint64_t off = (uint64_t)i * piece;
        pcs[i].src = src + off;
        pcs[i].dst = dst ? dst + off : NULL;
        pcs[i].len = off + piece <= len ? piece : len - off;
        pcs[i].crc = 0;
    }
    pthread_mutex_lock(&w->pm);
    w->pieces = pcs;
    w->n_pieces = n;
    w->next_piece = 0;
    w->done_pieces = 0;
    pthread_cond_broadcast(&w->pcv);
    pthread_mutex_unlock(&w->pm);
    run_pieces(w);
    pthread_mutex_lock(&w->pm);
    while (w->done_pieces < w->n_pieces) pthread_cond_wait(&w->dcv, &w->pm);
    w->n_pieces = w->next_piece = w->done_pieces = 0;
    w->pieces = NULL;
    pthread_mutex_unlock(&w->pm);
    uint32_t crc = pcs[0].crc, full = crc_shift_op(piece);
    for (int i = 1; i < n; i++)
        crc = gf2_multmodp(pcs[i].len == piece ? full : crc_shift_op(pcs[i].len), crc) ^ pcs[i].crc;
    return crc;
}

/* lay out, checksum and store one epoch of records (core/epochs.py layout_epoch): 0 written, 1 needs a new
 * segment (w->need), -1 failed */
static int store_epoch(Writer *w, Rec *recs, int nr) {

    /* layout (core/epochs.py layout_epoch) */
    uint64_t start = w->end;
    uint64_t desc_bytes = 0;
    for (int i = 0; i < nr; i++) desc_bytes += ENTRY_BYTES + align_up(recs[i].name_len + rec_var_len(&recs[i]), 8);
    uint64_t cursor = align_up(start + EPOCH_HEADER_BYTES + desc_bytes, ALIGN) - start;
    uint64_t payload_area = cursor, last_end = 0;
    int any_payload = 0;
    for (int i = 0; i < nr; i++) {
        if (recs[i].rtype == REC_META) continue;
        cursor = align_up(start + cursor, ALIGN) - start;
        recs[i].off = cursor;
        cursor += recs[i].plen;
        last_end = cursor;
        any_payload = 1;
    }
    uint64_t total = cursor + COMMIT_BYTES;
    uint64_t payload_bytes = any_payload ? last_end - payload_area : 0;
    if (total > w->cap - w->end ||
        (w->seg_epochs > 0 && (w->end + total > w->soft_max || __atomic_load_n(&w->roll_req, __ATOMIC_ACQUIRE)))) {
        w->need = total;
        return 1;
    }
    if (payload_area > w->head_cap) {
        uint8_t *h = realloc(w->head, payload_area);
        if (!h) return set_error(w, ERR_WRITE, ENOMEM, start, "out of memory for an epoch head");
        w->head = h;
        w->head_cap = payload_area;
    }
    for (int i = 0; i < nr; i++)
        if (recs[i].rtype != REC_META) {
            recs[i].placed = 0;
            uint8_t *dst = w->kind == TARGET_MAPPED ? w->base + start + recs[i].off : NULL;
            if (w->pool_ready && recs[i].plen >= w->par_min) { /* large: copied (mapped) + checksummed in pieces */
                recs[i].crc = par_crc_copy(w, recs[i].payload, dst, recs[i].plen);
                recs[i].placed = dst != NULL;
            } else if (dst && w->fuse && recs[i].plen >= w->par_min) { /* one thread: fused, read once */
                recs[i].crc = piece_crc_copy(recs[i].payload, dst, recs[i].plen, w->fuse);
                recs[i].placed = 1;
            } else {
                recs[i].crc = crc32c(0, recs[i].payload, recs[i].plen);
            }
        }
    /* descriptors */
    uint8_t *d = w->head + EPOCH_HEADER_BYTES;
    for (int i = 0; i < nr; i++) {
        Rec *r = &recs[i];
        size_t vlen = r->name_len + rec_var_len(r);
        put16(d, (uint16_t)r->rtype);
        put16(d + 2, 0);
        put32(d + 4, (uint32_t)r->name_len);
        put64(d + 8, r->count);
        put64(d + 16, vlen);
        put64(d + 24, r->rtype == REC_META ? 0 : r->off);
        put64(d + 32, r->rtype == REC_META ? 0 : r->plen);
        put32(d + 40, r->rtype == REC_META ? 0 : r->crc);
        put32(d + 44, 0);
        uint8_t *v = d + ENTRY_BYTES;
        memcpy(v, r->name, r->name_len);
        memcpy(v + r->name_len, r->var, r->var_len);
        size_t padded = align_up(vlen, 8);
        memset(v + vlen, 0, padded - vlen);
        d = v + padded;
    }
    uint32_t desc_crc = crc32c(0, w->head + EPOCH_HEADER_BYTES, desc_bytes);
    uint8_t *h = w->head;
    memcpy(h, "CFTEPOCH", 8);
    put16(h + 8, FORMAT_VERSION);
    put16(h + 10, 0);
    put32(h + 12, (uint32_t)nr);
    put64(h + 16, (uint64_t)w->next_epoch);
    put64(h + 24, desc_bytes);
    put64(h + 32, total);
    put64(h + 40, payload_bytes);
    put32(h + 48, crc32c(0, h, 48));
    put32(h + 52, desc_crc);
    memset(w->head + EPOCH_HEADER_BYTES + desc_bytes, 0, payload_area - EPOCH_HEADER_BYTES - desc_bytes);
    uint8_t commit[COMMIT_BYTES];
    memcpy(commit, "CFTCOMMT", 8);
    put64(commit + 8, (uint64_t)w->next_epoch);
    put64(commit + 16, total);
    put32(commit + 24, desc_crc);
    put32(commit + 28, crc32c(0, commit, 28));

    if (w->kind == TARGET_MAPPED) {
        uint8_t *dst = w->base + start;
        uint64_t pos = payload_area;
        for (int i = 0; i < nr; i++) { /* payloads (and the zeros between them) first */
            Rec *r = &recs[i];
            if (r->rtype == REC_META) continue;
            if (r->off > pos) memset(dst + pos, 0, r->off - pos);
            if (!r->placed) memcpy(dst + r->off, r->payload, r->plen);
            pos = r->off + r->plen;
        }
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        memcpy(dst, w->head, payload_area); /* then header + descriptors */
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        memcpy(dst + total - COMMIT_BYTES, commit, COMMIT_BYTES); /* the commit marker last */
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
    } else {
        struct iovec iov[2 * MAX_RECORDS + 2];
        int ni = 0;
        uint64_t pos = payload_area;
        iov[ni].iov_base = w->head;
        iov[ni++].iov_len = payload_area;
        for (int i = 0; i < nr; i++) {
            Rec *r = &recs[i];
            if (r->rtype == REC_META) continue;
            if (r->off > pos) { iov[ni].iov_base = w->zeros; iov[ni++].iov_len = r->off - pos; }
            iov[ni].iov_base = (void *)r->payload;
            iov[ni++].iov_len = r->plen;
            pos = r->off + r->plen;
        }
        iov[ni].iov_base = commit;
        iov[ni++].iov_len = COMMIT_BYTES;
        uint64_t off = start, left = total;
        int first = 0;
        while (left) {
            ssize_t k = pwritev(w->fd, iov + first, ni - first, (off_t)off);
            if (k < 0) {
                if (errno == EINTR) continue;
                return set_error(w, ERR_WRITE, errno, start, "writing epoch %lld at offset %llu", (long long)w->next_epoch,
                                 (unsigned long long)start);
            }
            off += (uint64_t)k;
            left -= (uint64_t)k;
            while (k > 0 && first < ni) { /* skip what went out */
                if ((size_t)k >= iov[first].iov_len) { k -= (ssize_t)iov[first].iov_len; first++; }
                else { iov[first].iov_base = (uint8_t *)iov[first].iov_base + k; iov[first].iov_len -= (size_t)k; k = 0; }
            }
        }
        if (w->fsync_mode == FSYNC_ALWAYS && fdatasync(w->fd) != 0)
            return set_error(w, ERR_WRITE, errno, start, "fdatasync of epoch %lld", (long long)w->next_epoch);
    }
    w->end = start + total;
    w->seg_epochs++;
    w->epochs++;
    w->bytes_written += (int64_t)total;
    w->last_total = total;
    if (w->kind == TARGET_MAPPED || w->fsync_mode == FSYNC_ALWAYS) { /* tmpfs: the stores are the page cache */
        w->synced_end = w->end;
        w->durable_epoch = w->next_epoch;
    }
    w->next_epoch++;
    return 0;
}

/* the interval policy: fdatasync when the oldest unsynced byte is older than the interval (called without mu) */
static int maybe_sync(Writer *w, int64_t now) {
    if (w->kind != TARGET_FILE || w->fsync_mode != FSYNC_INTERVAL || w->synced_end >= w->end) return 0;
    if (now - w->last_sync_ns < w->interval_ns) return 0;
    if (fdatasync(w->fd) != 0)
        return set_error(w, ERR_SYNC, errno, w->end, "background fdatasync of the active segment");
    w->synced_end = w->end;
    w->durable_epoch = w->next_epoch - 1;
    w->last_sync_ns = now_ns(CLOCK_MONOTONIC);
    return 0;
}

static int grow_stats(Writer *w) {
    if (w->n_stats < w->stats_cap) return 0;
    size_t cap = w->stats_cap ? 2 * w->stats_cap : 1024;
    Stat *s = realloc(w->stats, cap * sizeof *s);
    if (!s) return -1;
    w->stats = s;
    w->stats_cap = cap;
    return 0;
}

/* ------------------------------------------------------------------------------------------------ Python */
static void Writer_dealloc(Writer *w) {
    if (w->pool_ready) {
        pthread_mutex_lock(&w->pm);
        w->pool_quit = 1;
        pthread_cond_broadcast(&w->pcv);
        pthread_mutex_unlock(&w->pm);
        for (int i = 0; i < w->n_helpers; i++) pthread_join(w->helpers[i], NULL);
        pthread_mutex_destroy(&w->pm);
        pthread_cond_destroy(&w->pcv);
        pthread_cond_destroy(&w->dcv);
    }
    if (w->sync_ready) {
        pthread_mutex_destroy(&w->mu);
        pthread_cond_destroy(&w->cv);
    }
    free(w->chunks); free(w->chunk_off); free(w->chunk_len); free(w->holes);
    if (w->q)
        for (uint64_t i = w->q_tail; i < w->q_head; i++) free(w->q[i % w->q_cap].blob);
    free(w->q); free(w->head); free(w->meta); free(w->stats);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static int Writer_init(Writer *w, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"ring", "n_slots", "slot_bytes", "slot_header", "max_pages", "kv_page_bytes", "kv_name",
                             "tokens", "tokens_nbytes", "tokens_page_bytes", "tokens_name", "meta_chunks",
                             "meta_holes", NULL};
    unsigned long long ring, n_slots, slot_bytes, slot_header, max_pages, kv_pb, tok, tok_nbytes, tok_pb;
    Py_buffer kvn, tkn;
    PyObject *chunks, *holes;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKKKKKy*KKKy*OO", kwlist, &ring, &n_slots, &slot_bytes, &slot_header,
                                     &max_pages, &kv_pb, &kvn, &tok, &tok_nbytes, &tok_pb, &tkn, &chunks, &holes))
        return -1;
    int rc = -1;
    if (kvn.len >= MAX_NAME || tkn.len >= MAX_NAME) { PyErr_SetString(PyExc_ValueError, "region name too long"); goto out; }
    if (!n_slots || !kv_pb || !tok_pb || slot_header < 40 || slot_bytes < slot_header + max_pages * kv_pb) {
        PyErr_SetString(PyExc_ValueError, "ring geometry does not add up");
        goto out;
    }
    if (!PyList_Check(chunks) || !PyList_Check(holes) || PyList_GET_SIZE(chunks) != PyList_GET_SIZE(holes) + 1) {
        PyErr_SetString(PyExc_ValueError, "meta_chunks must be a list one longer than the list meta_holes");
        goto out;
    }
    w->ring = (const uint8_t *)(uintptr_t)ring;
    w->n_slots = n_slots; w->slot_bytes = slot_bytes; w->slot_header = slot_header; w->max_pages = max_pages;
    w->kv_pb = kv_pb;
    memcpy(w->kv_name, kvn.buf, (size_t)kvn.len); w->kv_name_len = (size_t)kvn.len;
    w->tok = (uint8_t *)(uintptr_t)tok; w->tok_nbytes = tok_nbytes; w->tok_pb = tok_pb;
    memcpy(w->tok_name, tkn.buf, (size_t)tkn.len); w->tok_name_len = (size_t)tkn.len;
    Py_ssize_t nh = PyList_GET_SIZE(holes);
    w->n_holes = (int)nh;
    w->holes = calloc((size_t)nh + 1, sizeof(int));
    w->chunk_off = calloc((size_t)nh + 1, sizeof(size_t));
    w->chunk_len = calloc((size_t)nh + 1, sizeof(size_t));
    size_t total = 0;
    for (Py_ssize_t i = 0; i <= nh; i++) {
        PyObject *c = PyList_GET_ITEM(chunks, i);
        if (!PyBytes_Check(c)) { PyErr_SetString(PyExc_TypeError, "meta_chunks must be bytes"); goto out; }
        total += (size_t)PyBytes_GET_SIZE(c);
    }
    w->chunks = malloc(total + 1);
    w->meta_cap = total + (size_t)nh * 48 + 1;
    w->meta = malloc(w->meta_cap);
    w->q_cap = n_slots + 8;
    w->q = calloc(w->q_cap, sizeof(Item));
    if (!w->holes || !w->chunk_off || !w->chunk_len || !w->chunks || !w->meta || !w->q) { PyErr_NoMemory(); goto out; }
    size_t off = 0;
    for (Py_ssize_t i = 0; i <= nh; i++) {
        PyObject *c = PyList_GET_ITEM(chunks, i);
        size_t n = (size_t)PyBytes_GET_SIZE(c);
        memcpy(w->chunks + off, PyBytes_AS_STRING(c), n);
        w->chunk_off[i] = off; w->chunk_len[i] = n;
        off += n;
        if (i < nh) {
            long k = PyLong_AsLong(PyList_GET_ITEM(holes, i));
            if (k < 0 || k >= N_HOLE_KINDS) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "unknown meta hole kind");
                goto out;
            }
            w->holes[i] = (int)k;
        }
    }
    w->chunks_total = total;
    if (!w->sync_ready) {
        pthread_mutex_init(&w->mu, NULL);
        pthread_cond_init(&w->cv, NULL);
        w->sync_ready = 1;
    }
    w->committed = -1;
    w->fd = -1;
    rc = 0;
out:
    PyBuffer_Release(&kvn);
    PyBuffer_Release(&tkn);
    return rc;
}

/* StepWriter(queue): generic epochs, each submitted as a records blob (write_blob) */
static int StepWriter_init(Writer *w, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"queue", "threads", "parallel_min_bytes", "fuse_bytes", NULL};
    unsigned long long queue = 64, par_min = 1 << 20, fuse = 256 << 10;
    int threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|KiKK", kwlist, &queue, &threads, &par_min, &fuse)) return -1;
    if (fuse && (fuse < 4096 || fuse % 64)) {
        PyErr_SetString(PyExc_ValueError, "fuse_bytes must be 0 or a multiple of 64 of at least 4096");
        return -1;
    }
    if (threads < 1 || threads > MAX_HELPERS + 1) {
        PyErr_Format(PyExc_ValueError, "threads must be 1 to %d", MAX_HELPERS + 1);
        return -1;
    }
    if (w->q) { PyErr_SetString(PyExc_RuntimeError, "StepWriter initialised twice"); return -1; }
    if (queue < 1 || queue > (1u << 20)) { PyErr_SetString(PyExc_ValueError, "queue must be 1 to 2^20"); return -1; }
    w->generic = 1;
    w->q_cap = queue;
    w->q = calloc(w->q_cap, sizeof(Item));
    if (!w->q) { PyErr_NoMemory(); return -1; }
    if (!w->sync_ready) {
        pthread_mutex_init(&w->mu, NULL);
        pthread_cond_init(&w->cv, NULL);
        w->sync_ready = 1;
    }
    w->committed = -1;
    w->last_seq = -1;
    w->fd = -1;
    w->par_min = par_min ? par_min : 1;
    w->fuse = fuse;
    if (threads > 1) {
        pthread_mutex_init(&w->pm, NULL);
        pthread_cond_init(&w->pcv, NULL);
        pthread_cond_init(&w->dcv, NULL);
        w->pool_ready = 1;
        for (int i = 0; i < threads - 1; i++) {
            if (pthread_create(&w->helpers[i], NULL, helper_main, w) != 0) break;
            w->n_helpers++;
        }
        if (!w->n_helpers) w->pool_ready = 0; /* no helper started: one thread does it all */
    }
    return 0;
}

/* submit(seq, blob): queue step seq's epoch (the blob is copied; the payloads it names are not) */
static PyObject *StepWriter_submit(Writer *w, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "submit(seq, blob)"); return NULL; }
    Item it;
    memset(&it, 0, sizeof it);
    it.seq = PyLong_AsLongLong(args[0]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[1], &b, PyBUF_SIMPLE) < 0) return NULL;
    it.blob = malloc(b.len ? (size_t)b.len : 1);
    if (!it.blob) { PyBuffer_Release(&b); return PyErr_NoMemory(); }
    memcpy(it.blob, b.buf, (size_t)b.len);
    it.blob_len = (size_t)b.len;
    PyBuffer_Release(&b);
    it.submit_ns = now_ns(CLOCK_MONOTONIC);
    pthread_mutex_lock(&w->mu);
    if (w->q_head - w->q_tail >= w->q_cap) {
        pthread_mutex_unlock(&w->mu);
        free(it.blob);
        PyErr_SetString(PyExc_RuntimeError, "step writer queue is full (more epochs in flight than its queue holds)");
        return NULL;
    }
    if (it.seq <= w->last_seq) {
        pthread_mutex_unlock(&w->mu);
        free(it.blob);
        PyErr_Format(PyExc_ValueError, "step %lld submitted after step %lld: steps go in increasing order",
                     (long long)it.seq, (long long)w->last_seq);
        return NULL;
    }
    w->last_seq = it.seq;
    w->q[w->q_head % w->q_cap] = it;
    w->q_head++;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    Py_RETURN_NONE;
}

static PyObject *Writer_set_target(Writer *w, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"kind", "address", "fd", "end", "capacity", "soft_max", "segment_epochs", "next_epoch",
                             "fsync", "interval_ns", "synced_end", "durable_epoch", NULL};
    int kind, fd, fsync_mode;
    unsigned long long addr, end, cap, soft_max, synced_end;
    long long seg_epochs, next_epoch, interval_ns, durable_epoch;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iKiKKKLLiLKL", kwlist, &kind, &addr, &fd, &end, &cap, &soft_max,
                                     &seg_epochs, &next_epoch, &fsync_mode, &interval_ns, &synced_end, &durable_epoch))
        return NULL;
    if ((kind != TARGET_MAPPED && kind != TARGET_FILE) || (kind == TARGET_MAPPED && !addr) ||
        (kind == TARGET_FILE && fd < 0) || end > cap || fsync_mode < 0 || fsync_mode > 2) {
        PyErr_SetString(PyExc_ValueError, "bad target for the slot-log writer");
        return NULL;
    }
    pthread_mutex_lock(&w->mu);
    w->kind = kind; w->base = (uint8_t *)(uintptr_t)addr; w->fd = fd; w->end = end; w->cap = cap;
    w->soft_max = soft_max; w->seg_epochs = seg_epochs; w->next_epoch = next_epoch; w->fsync_mode = fsync_mode;
    w->interval_ns = interval_ns; w->synced_end = synced_end; w->durable_epoch = durable_epoch;
    w->last_sync_ns = now_ns(CLOCK_MONOTONIC);
    w->rolling = 0;
    __atomic_store_n(&w->roll_req, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&w->mu);
    Py_RETURN_NONE;
}

static PyObject *Writer_submit(Writer *w, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "submit(seq, n_tokens, n_new, done)"); return NULL; }
    Item it;
    memset(&it, 0, sizeof it);
    it.seq = PyLong_AsLongLong(args[0]);
    it.n_tokens = PyLong_AsLongLong(args[1]);
    it.n_new = PyLong_AsLongLong(args[2]);
    it.done = PyObject_IsTrue(args[3]);
    if (PyErr_Occurred()) return NULL;
    it.submit_ns = now_ns(CLOCK_MONOTONIC);
    pthread_mutex_lock(&w->mu);
    if (w->q_head - w->q_tail >= w->q_cap) {
        pthread_mutex_unlock(&w->mu);
        PyErr_SetString(PyExc_RuntimeError, "slot-log writer queue is full (more steps submitted than ring slots)");
        return NULL;
    }
    w->q[w->q_head % w->q_cap] = it;
    w->q_head++;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    Py_RETURN_NONE;
}

static PyObject *Writer_fail(Writer *w, PyObject *unused) {
    (void)unused;
    pthread_mutex_lock(&w->mu);
    w->failed = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    Py_RETURN_NONE;
}

static PyObject *Writer_request_roll(Writer *w, PyObject *unused) {
    (void)unused;
    __atomic_store_n(&w->roll_req, 1, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *Writer_stop(Writer *w, PyObject *unused) {
    (void)unused;
    pthread_mutex_lock(&w->mu);
    w->stop_req = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    Py_RETURN_NONE;
}

static void timed_wait(Writer *w, int64_t ns) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t t = (int64_t)ts.tv_nsec + ns;
    ts.tv_sec += (time_t)(t / 1000000000ll);
    ts.tv_nsec = (long)(t % 1000000000ll);
    pthread_cond_timedwait(&w->cv, &w->mu, &ts);
}

/* the writer loop: returns RUN_* */
static PyObject *Writer_run(Writer *w, PyObject *unused) {
    (void)unused;
    int result;
    if (w->kind == TARGET_NONE) { PyErr_SetString(PyExc_RuntimeError, "set_target before run"); return NULL; }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->mu);
    w->running = 1;
    for (;;) {
        if (w->failed) { result = RUN_FAILED; break; }
        if (w->q_tail < w->q_head) {
            Item it = w->q[w->q_tail % w->q_cap];
            pthread_mutex_unlock(&w->mu);
            int64_t t0 = now_ns(CLOCK_MONOTONIC);
            int rc = it.blob ? write_blob(w, &it) : write_one(w, &it);
            int64_t t1 = now_ns(CLOCK_MONOTONIC);
            if (rc == 0) rc = maybe_sync(w, t1);
            pthread_mutex_lock(&w->mu);
            if (rc == 1) { w->rolling = 1; result = RUN_ROLL; break; }
            if (rc < 0) { w->failed = 1; result = RUN_FAILED; break; }
            if (grow_stats(w) == 0)
                w->stats[w->n_stats++] = (Stat){it.seq, it.submit_ns, t0, t1, (int64_t)w->last_total, w->next_epoch - 1};
            w->q_tail++;
            free(it.blob);
            __atomic_store_n(&w->committed_epoch, w->next_epoch - 1, __ATOMIC_RELAXED);
            __atomic_store_n(&w->committed, it.seq, __ATOMIC_RELEASE);
            pthread_cond_broadcast(&w->cv);
            continue;
        }
        if (w->stop_req) { result = RUN_STOPPED; break; }
        if (w->kind == TARGET_FILE && w->fsync_mode == FSYNC_INTERVAL && w->synced_end < w->end) {
            int64_t due = w->last_sync_ns + w->interval_ns - now_ns(CLOCK_MONOTONIC);
            if (due > 0) timed_wait(w, due);
            else {
                pthread_mutex_unlock(&w->mu);
                int rc = maybe_sync(w, now_ns(CLOCK_MONOTONIC));
                pthread_mutex_lock(&w->mu);
                if (rc < 0) { w->failed = 1; result = RUN_FAILED; break; }
            }
        } else {
            pthread_cond_wait(&w->cv, &w->mu);
        }
    }
    w->running = 0;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(result);
}

/* wait(seq, timeout_s) -> committed seq (may be < seq: failed, or the timeout passed) */
static PyObject *Writer_wait(Writer *w, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "wait(seq, timeout_s)"); return NULL; }
    long long seq = PyLong_AsLongLong(args[0]);
    double timeout = PyFloat_AsDouble(args[1]);
    if (PyErr_Occurred()) return NULL;
    int64_t c = __atomic_load_n(&w->committed, __ATOMIC_ACQUIRE);
    if (c >= seq) return PyLong_FromLongLong(c);
    Py_BEGIN_ALLOW_THREADS
    int64_t deadline = now_ns(CLOCK_MONOTONIC) + (int64_t)(timeout * 1e9);
    pthread_mutex_lock(&w->mu);
    while (w->committed < seq && !w->failed) {
        int64_t left = deadline - now_ns(CLOCK_MONOTONIC);
        if (left <= 0) break;
        timed_wait(w, left);
    }
    c = w->committed;
    pthread_mutex_unlock(&w->mu);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(c);
}

/* token(seq) -> the token of step seq from its slot, or None when the slot does not hold it */
static PyObject *Writer_token(Writer *w, PyObject *arg) {
    long long seq = PyLong_AsLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    const int64_t *words = (const int64_t *)(w->ring + (uint64_t)(seq % (long long)w->n_slots) * w->slot_bytes);
    if (__atomic_load_n(&words[0], __ATOMIC_ACQUIRE) != seq + 1) Py_RETURN_NONE;
    return PyLong_FromLongLong(__atomic_load_n(&words[1], __ATOMIC_RELAXED));
}

static PyObject *Writer_last_epoch(Writer *w, PyObject *unused) {
    (void)unused;
    return PyLong_FromLongLong(__atomic_load_n(&w->committed_epoch, __ATOMIC_ACQUIRE));
}

static PyObject *Writer_state(Writer *w, PyObject *unused) {
    (void)unused;
    pthread_mutex_lock(&w->mu);
    PyObject *d = Py_BuildValue(
        "{s:L,s:K,s:K,s:L,s:L,s:L,s:L,s:L,s:i,s:i,s:K,s:K,s:i}", "committed", (long long)w->committed, "end",
        (unsigned long long)w->end, "synced_end", (unsigned long long)w->synced_end, "segment_epochs",
        (long long)w->seg_epochs, "next_epoch", (long long)w->next_epoch, "durable_epoch", (long long)w->durable_epoch,
        "epochs", (long long)w->epochs, "bytes_written", (long long)w->bytes_written, "failed", w->failed, "rolling",
        w->rolling, "need", (unsigned long long)w->need, "queued", (unsigned long long)(w->q_head - w->q_tail),
        "running", w->running);
    pthread_mutex_unlock(&w->mu);
    return d;
}

static PyObject *Writer_error(Writer *w, PyObject *unused) {
    (void)unused;
    if (w->err_kind == ERR_NONE) Py_RETURN_NONE;
    return Py_BuildValue("(iisKL)", w->err_kind, w->err_errno, w->err_text, (unsigned long long)w->err_start,
                         (long long)w->err_epoch);
}

/* stats() -> bytes of int64 rows (seq, submit_ns, start_ns, commit_ns, total_bytes, epoch) of every committed epoch */
static PyObject *Writer_stats(Writer *w, PyObject *unused) {
    (void)unused;
    pthread_mutex_lock(&w->mu);
    PyObject *b = PyBytes_FromStringAndSize((const char *)w->stats, (Py_ssize_t)(w->n_stats * sizeof(Stat)));
    pthread_mutex_unlock(&w->mu);
    return b;
}

static PyMethodDef Writer_methods[] = {
    {"set_target", (PyCFunction)(void (*)(void))Writer_set_target, METH_VARARGS | METH_KEYWORDS,
     "set_target(kind, address, fd, end, capacity, soft_max, segment_epochs, next_epoch, fsync, interval_ns, "
     "synced_end, durable_epoch): the segment to append to (kind 1 mapped, 2 file)"},
    {"submit", (PyCFunction)(void (*)(void))Writer_submit, METH_FASTCALL, "submit(seq, n_tokens, n_new, done)"},
    {"fail", (PyCFunction)Writer_fail, METH_NOARGS, "mark the writer failed (the Python side failed a roll)"},
    {"stop", (PyCFunction)Writer_stop, METH_NOARGS, "finish the queue, then run() returns 0"},
    {"run", (PyCFunction)Writer_run, METH_NOARGS, "the writer loop, GIL released: 0 stopped, 1 roll, 2 failed"},
    {"wait", (PyCFunction)(void (*)(void))Writer_wait, METH_FASTCALL, "wait(seq, timeout_s) -> committed seq"},
    {"token", (PyCFunction)Writer_token, METH_O, "token(seq) -> int or None"},
    {"last_epoch", (PyCFunction)Writer_last_epoch, METH_NOARGS, "the epoch number of the last commit (0: none)"},
    {"state", (PyCFunction)Writer_state, METH_NOARGS, "progress and the target's state, as a dict"},
    {"error", (PyCFunction)Writer_error, METH_NOARGS, "(kind, errno, text, start, epoch) or None"},
    {"stats", (PyCFunction)Writer_stats, METH_NOARGS, "int64 rows (seq, submit, start, commit ns, bytes, epoch)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WriterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "concordia_ft.core._slotlog.Writer",
    .tp_basicsize = sizeof(Writer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Writer_init,
    .tp_dealloc = (destructor)Writer_dealloc,
    .tp_methods = Writer_methods,
    .tp_doc = "Ring slots -> committed log epochs, GIL released (see the module's source header).",
};

static PyMethodDef StepWriter_methods[] = {
    {"set_target", (PyCFunction)(void (*)(void))Writer_set_target, METH_VARARGS | METH_KEYWORDS,
     "set_target(...): the segment to append to, as Writer.set_target"},
    {"submit", (PyCFunction)(void (*)(void))StepWriter_submit, METH_FASTCALL, "submit(seq, blob)"},
    {"request_roll", (PyCFunction)Writer_request_roll, METH_NOARGS,
     "roll to a new segment before the next epoch (unless the segment holds none): run() returns 1 there"},
    {"fail", (PyCFunction)Writer_fail, METH_NOARGS, "mark the writer failed (the Python side failed a roll)"},
    {"stop", (PyCFunction)Writer_stop, METH_NOARGS, "finish the queue, then run() returns 0"},
    {"run", (PyCFunction)Writer_run, METH_NOARGS, "the writer loop, GIL released: 0 stopped, 1 roll, 2 failed"},
    {"wait", (PyCFunction)(void (*)(void))Writer_wait, METH_FASTCALL, "wait(seq, timeout_s) -> committed seq"},
    {"last_epoch", (PyCFunction)Writer_last_epoch, METH_NOARGS, "the epoch number of the last commit (0: none)"},
    {"state", (PyCFunction)Writer_state, METH_NOARGS, "progress and the target's state, as a dict"},
    {"error", (PyCFunction)Writer_error, METH_NOARGS, "(kind, errno, text, start, epoch) or None"},
    {"stats", (PyCFunction)Writer_stats, METH_NOARGS, "int64 rows (seq, submit, start, commit ns, bytes, epoch)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StepWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "concordia_ft.core._slotlog.StepWriter",
    .tp_basicsize = sizeof(Writer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)StepWriter_init,
    .tp_dealloc = (destructor)Writer_dealloc,
    .tp_methods = StepWriter_methods,
    .tp_doc = "Step epochs (records blobs naming host payloads) -> committed log epochs, GIL released.",
};

static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b;
    unsigned int value = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &b, &value)) return NULL;
    uint32_t c = crc32c(value, b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(c);
}

/* ------------------------------------------------------------------------- CRC32C of large buffers, in parallel
 * A placed epoch (core/log.py) checksums tens of MB that a DMA just put into the log's pages. ``crc32c_buffers``
 * cuts every buffer into ``piece``-byte pieces, has ``threads`` threads (the caller's one of them) take pieces
 * in turn with the GIL released throughout, and combines each buffer's piece CRCs exactly (the GF(2) shift
 * core/checksums.py's crc32c_combine uses): one call, one GIL release, no Python per piece. */
typedef struct {
    const uint8_t *const *bufs;
    const size_t *lens;
    const size_t *first; /* index of each buffer's first piece */
    size_t nbufs, npieces, piece;
    uint32_t *crcs;
    size_t next; /* atomic: the next piece to take */
    /* gates (optional): piece bytes of buffer gate_buf[g] below gate_end[g] are there once the host word
     * flags[gate_flag[g]] equals tag (a DMA in flight, the GPU's stream writes the word after each chunk) */
    const volatile uint32_t *flags;
    size_t ngates;
    const size_t *gate_buf, *gate_end, *gate_flag;
    const uint32_t *gate_tag;
    int64_t timeout_ns;
    int failed; /* atomic: a gate did not open in time */
} CrcTeam;

static int crc_gate_wait(CrcTeam *t, size_t b, size_t end) {
    for (size_t g = 0; g < t->ngates; g++) {
        if (t->gate_buf[g] != b || t->gate_end[g] < end) continue;
        const volatile uint32_t *w = t->flags + t->gate_flag[g];
        uint32_t tag = t->gate_tag[g];
        if (*w == tag) return 0;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        int64_t deadline = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec + t->timeout_ns;
        while (*w != tag) {
            if (__atomic_load_n(&t->failed, __ATOMIC_RELAXED)) return -1;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            if ((int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec > deadline) return -1;
#ifdef CFT_X86
            _mm_pause();
#endif
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        return 0;
    }
    return 0; /* no gate covers it: the bytes are there already */
}

static void *crc_team_work(void *arg) {
    CrcTeam *t = (CrcTeam *)arg;
    for (;;) {
        size_t k = __atomic_fetch_add(&t->next, 1, __ATOMIC_RELAXED);
        if (k >= t->npieces) break;
        size_t b = 0; /* the buffer of piece k (few buffers: a linear search) */
        while (b + 1 < t->nbufs && t->first[b + 1] <= k) b++;
        size_t off = (k - t->first[b]) * t->piece;
        size_t len = t->lens[b] - off < t->piece ? t->lens[b] - off : t->piece;
        if (t->ngates && crc_gate_wait(t, b, off + len) != 0) {
            __atomic_store_n(&t->failed, 1, __ATOMIC_RELAXED);
            break;
        }
        t->crcs[k] = crc32c(0, t->bufs[b] + off, len);
    }
    return NULL;
}

static PyObject *py_crc32c_buffers(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *seq, *gates_obj = NULL;
    int threads = 8;
    Py_ssize_t piece = 1 << 20;
    unsigned long long flags_addr = 0;
    long long timeout_ns = 2000000000LL;
    if (!PyArg_ParseTuple(args, "O|inKOL", &seq, &threads, &piece, &flags_addr, &gates_obj, &timeout_ns))
        return NULL;
    size_t ngates = 0;
    size_t *gate_buf = NULL, *gate_end = NULL, *gate_flag = NULL;
    uint32_t *gate_tag = NULL;
    if (gates_obj && gates_obj != Py_None) {
        PyObject *gf = PySequence_Fast(gates_obj, "crc32c_buffers: gates are (buffer, end, flag, tag) tuples");
        if (!gf) return NULL;
        ngates = (size_t)PySequence_Fast_GET_SIZE(gf);
        gate_buf = (size_t *)calloc(ngates + 1, sizeof(size_t));
        gate_end = (size_t *)calloc(ngates + 1, sizeof(size_t));
        gate_flag = (size_t *)calloc(ngates + 1, sizeof(size_t));
        gate_tag = (uint32_t *)calloc(ngates + 1, sizeof(uint32_t));
        int bad = !gate_buf || !gate_end || !gate_flag || !gate_tag;
        for (size_t g = 0; !bad && g < ngates; g++) {
            Py_ssize_t gb, ge, gl;
            unsigned int gt;
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(gf, (Py_ssize_t)g), "nnnI", &gb, &ge, &gl, &gt) || gb < 0 ||
                ge < 0 || gl < 0)
                bad = 1;
            else {
                gate_buf[g] = (size_t)gb;
                gate_end[g] = (size_t)ge;
                gate_flag[g] = (size_t)gl;
                gate_tag[g] = (uint32_t)gt;
            }
        }
        Py_DECREF(gf);
        if (bad || (ngates && !flags_addr)) {
            free(gate_buf);
            free(gate_end);
            free(gate_flag);
            free(gate_tag);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "crc32c_buffers: bad gates or no flags address");
            return NULL;
        }
    }
    if (piece < 4096 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "crc32c_buffers: piece must be >= 4096 and threads >= 1");
        free(gate_buf);
        free(gate_end);
        free(gate_flag);
        free(gate_tag);
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "crc32c_buffers: a sequence of buffers");
    if (!fast) {
        free(gate_buf);
        free(gate_end);
        free(gate_flag);
        free(gate_tag);
        return NULL;
    }
    Py_ssize_t nb = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *views = (Py_buffer *)calloc((size_t)(nb ? nb : 1), sizeof(Py_buffer));
    const uint8_t **bufs = (const uint8_t **)calloc((size_t)(nb ? nb : 1), sizeof(*bufs));
    size_t *lens = (size_t *)calloc((size_t)(nb ? nb : 1), sizeof(size_t));
    size_t *first = (size_t *)calloc((size_t)(nb ? nb : 1), sizeof(size_t));
    uint32_t *out = (uint32_t *)calloc((size_t)(nb ? nb : 1), sizeof(uint32_t));
    uint32_t *crcs = NULL;
    PyObject *result = NULL;
    Py_ssize_t got = 0;
    if (!views || !bufs || !lens || !first || !out) {
        PyErr_NoMemory();
        goto done;
    }
    size_t npieces = 0;
    for (; got < nb; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, got), &views[got], PyBUF_SIMPLE) < 0) goto done;
        bufs[got] = (const uint8_t *)views[got].buf;
        lens[got] = (size_t)views[got].len;
        first[got] = npieces;
        npieces += lens[got] ? (lens[got] + (size_t)piece - 1) / (size_t)piece : 1;
    }
    crcs = (uint32_t *)calloc(npieces ? npieces : 1, sizeof(uint32_t));
    if (!crcs) {
        PyErr_NoMemory();
        goto done;
    }
    CrcTeam team = {bufs, lens, first, (size_t)nb, npieces, (size_t)piece, crcs, 0,
                    (const volatile uint32_t *)(uintptr_t)flags_addr, ngates, gate_buf, gate_end, gate_flag,
                    gate_tag, (int64_t)timeout_ns, 0};
    size_t nthreads = (size_t)threads < npieces ? (size_t)threads : npieces;
    Py_BEGIN_ALLOW_THREADS
    pthread_t tids[64];
    size_t started = 0;
    for (size_t i = 1; i < nthreads && i < 64; i++) {
        if (pthread_create(&tids[started], NULL, crc_team_work, &team) != 0) break; /* fewer threads: still right */
        started++;
    }
    crc_team_work(&team);
    for (size_t i = 0; i < started; i++) pthread_join(tids[i], NULL);
    uint32_t full = crc_shift_op((uint64_t)piece);
    for (Py_ssize_t b = 0; b < nb; b++) {
        size_t n = lens[b] ? (lens[b] + (size_t)piece - 1) / (size_t)piece : 1;
        uint32_t c = crcs[first[b]];
        for (size_t j = 1; j < n; j++) {
            size_t len = lens[b] - j * (size_t)piece < (size_t)piece ? lens[b] - j * (size_t)piece : (size_t)piece;
            c = gf2_multmodp(len == (size_t)piece ? full : crc_shift_op(len), c) ^ crcs[first[b] + j];
        }
        out[b] = c;
    }
    Py_END_ALLOW_THREADS
    if (team.failed) { /* a gate never opened: the caller waits for its copies and checksums again */
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    result = PyList_New(nb);
    if (!result) goto done;
    for (Py_ssize_t b = 0; b < nb; b++) {
        PyObject *v = PyLong_FromUnsignedLong(out[b]);
        if (!v) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, b, v);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    free(views);
    free(bufs);
    free(lens);
    free(first);
    free(out);
    free(crcs);
    free(gate_buf);
    free(gate_end);
    free(gate_flag);
    free(gate_tag);
    Py_DECREF(fast);
    return result;
}

static PyObject *py_crc_impl(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    return PyUnicode_FromString(crc_hw ? "sse4.2" : "table");
}

static PyMethodDef module_methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(buffer, value=0) -> CRC32C (Castagnoli), as the crc32c package"},
    {"crc_impl", py_crc_impl, METH_NOARGS, "'sse4.2' or 'table'"},
    {"crc32c_buffers", py_crc32c_buffers, METH_VARARGS,
     "crc32c_buffers(buffers, threads=8, piece=1 MiB) -> [CRC32C of each], GIL released, pieces on threads"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_slotlog", "Token-epoch writer with the GIL released.", -1,
                                    module_methods};

PyMODINIT_FUNC PyInit__slotlog(void) {
    crc_init();
    if (PyType_Ready(&WriterType) < 0 || PyType_Ready(&StepWriterType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&WriterType);
    if (PyModule_AddObject(m, "Writer", (PyObject *)&WriterType) < 0) {
        Py_DECREF(&WriterType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&StepWriterType);
    if (PyModule_AddObject(m, "StepWriter", (PyObject *)&StepWriterType) < 0) {
        Py_DECREF(&StepWriterType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "TARGET_MAPPED", TARGET_MAPPED);
    PyModule_AddIntConstant(m, "TARGET_FILE", TARGET_FILE);
    PyModule_AddIntConstant(m, "RUN_STOPPED", RUN_STOPPED);
    PyModule_AddIntConstant(m, "RUN_ROLL", RUN_ROLL);
    PyModule_AddIntConstant(m, "RUN_FAILED", RUN_FAILED);
    PyModule_AddIntConstant(m, "ERR_SLOT", ERR_SLOT);
    PyModule_AddIntConstant(m, "ERR_WRITE", ERR_WRITE);
    PyModule_AddIntConstant(m, "ERR_SYNC", ERR_SYNC);
    PyModule_AddIntConstant(m, "SLOT_WORDS", 5);
    return m;
}
