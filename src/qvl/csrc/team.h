/* The threads of one parallel region as a team that never waits for a thread that is not
 * running (its core taken by another program, an efficiency core, a busy vCPU).
 *
 * Every thread of the region runs the same program (the decode step's layers, or one product)
 * and meets the others at each "job": the pieces of work ("items") of one step of that program,
 * all of which must be done before any thread goes past it. A job's items are split into one
 * share per thread; a thread takes its own share's items from the front, in order (so that its
 * weights stream from memory as with an equal share, and it can ask for its next item's weights
 * while computing this one), then items from the back of the others' shares. A thread with
 * nothing left to take waits for the items others hold; when one is held longer than twice the
 * time an item takes it (its thread has stopped), it computes that item too: a job whose items
 * are computed into each thread's own buffer ("takeover" jobs: the decode products and
 * attention) commits each item once, by whichever thread finishes it first, and a thread that
 * comes back late finds its item committed and its result is dropped. Other jobs (the short
 * serial parts, work done in place) wait for their items' threads.
 *
 * An item's result never depends on which thread computes it, so the results are the same bits
 * whatever the number of threads and whoever computed what. A thread that falls behind passes the
 * jobs the others finished without doing anything, so the region's threads meet only once, at
 * its end. Waiting threads spin, then yield their core to whatever else wants it. */
#ifndef QVL_TEAM_H
#define QVL_TEAM_H
#include "common.h"

typedef struct __attribute__((aligned(64))) { /* one cache line each */
    int64_t word; /* job << 32 | items taken from the front << 16 | from the back (another job's: none yet) */
} TeamShare;

typedef struct {
    int threads;         /* shares per job: the region's threads */
    int64_t capacity;    /* items a takeover job may have */
    int64_t* item_state; /* [capacity]: job << 2 | 1 committing, 2 committed (an earlier job's: free) */
    TeamShare* shares;   /* [threads] */
    float* own;          /* [threads][own_floats]: the threads' own results */
    int64_t own_floats;
    int64_t committed __attribute__((aligned(64))); /* items done, over all jobs so far */
    int64_t taken_over;  /* items a waiting thread computed because their thread had stopped */
    int status;          /* the first nonzero status an item or serial part returned */
} Team;

/* One thread's place in the team's program. */
typedef struct {
    Team* team;
    int t;            /* this thread */
    int64_t job;      /* jobs begun */
    int64_t done;     /* items of all jobs up to this one (the team's `committed` once it is done) */
    float* own;       /* this thread's own result buffer */
} Walker;

/* The item being computed: its index, the thread's next item of its own share (-1: none; its
 * data can be asked from memory now), the buffer for a takeover job's result, and for an item
 * taken over from a stopped thread, the state it watches (team_item_dropped: committed already). */
typedef struct {
    int64_t index, next;
    float* own;
    const int64_t* watch;
    int64_t job;
} TeamItem;

typedef struct {
    int64_t items;
    int takeover;                                    /* results into own buffers, committed once */
    int (*run)(const void* ctx, const TeamItem* it); /* 0, or a status that fails the program */
    void (*commit)(const void* ctx, const TeamItem* it); /* takeover jobs: own -> the results' place */
    const void* ctx;
} TeamJob;

/* Whether another thread has committed the item `it` is a takeover of (stop computing it). */
static inline int team_item_dropped(const TeamItem* it) {
    return it->watch && (__atomic_load_n(it->watch, __ATOMIC_RELAXED) >> 2) >= it->job;
}

/* Share t of `items` among `threads`: items [*lo, *hi). */
static inline void team_share(int64_t items, int threads, int t, int64_t* lo, int64_t* hi) {
    *lo = items * t / threads;
    *hi = items * (t + 1) / threads;
}

/* Run `job` with the other threads of the team; returns the team's status once every item is done. */
int team_run(Walker* w, const TeamJob* job);

/* fn(ctx) run by one thread of the team (the first to get there) while the others wait. */
int team_serial(Walker* w, int (*fn)(const void* ctx), const void* ctx);

/* A program of one job (ctx: the TeamJob), for team_region. */
int team_one_job(Walker* w, const void* job);

/* Run program(w, ctx) on `threads` threads as one team (on one without OpenMP) whose takeover
 * jobs have at most `capacity` items and results of up to `own_floats` floats; returns the first
 * nonzero status (-1 when out of memory). *taken_over (or NULL) adds the items taken over. */
int team_region(int threads, int64_t capacity, int64_t own_floats, int (*program)(Walker* w, const void* ctx),
                const void* ctx, int64_t* taken_over);

/* The one-call decode step's jobs kept beside their kernels (attention_decode.c, delta_rule.c). */
int qvl_decode_attention_fits(const QvlAttention* a);
TeamJob qvl_decode_attention_job(const QvlAttention* a); /* takeover: (G = H/Hkv) * D floats per item */
int qvl_delta_step_fits(const QvlDeltaStep* a);
TeamJob qvl_delta_step_job(const QvlDeltaStep* a); /* in place */

#endif
