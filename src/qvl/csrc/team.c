/* The team of a parallel region (team.h): jobs shared out and taken over, waits that yield,
 * the counts `qvl info`, /metrics and the thread count read (qvl_team_counts), and the team's
 * threads placed on chosen cores (qvl_team_place). */
#define _GNU_SOURCE /* sched_setaffinity, CPU_SET */
#include "team.h"

#include <sched.h>
#include <stdio.h>
#include <time.h>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define SPINS_BEFORE_YIELD 4096 /* pauses (~0.1 ms) before a waiting thread yields its core at each check */
#define LEAST_GRACE_NS 20000    /* an item held this long at least before it is taken over */
#define MAX_SHARE 0xffff        /* items in one share (16 bits of its word) */

static int64_t counts[2]; /* items done and items taken over, by every team of this process */

/* Items done and items taken over from a stopped thread since the process started. */
void qvl_team_counts(int64_t* out) {
    out[0] = __atomic_load_n(&counts[0], __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&counts[1], __ATOMIC_RELAXED);
}

/* Each thread t of a `threads`-thread region (the pool qvl's kernels and torch's ops run on, for
 * the calling thread) on the CPUs cpus[first[t] .. first[t + 1]): pinned to a core, or back on all
 * of the process's. tids[t]: thread t's id (its /proc/self/task entry). 0; -1 where the threads
 * cannot be placed (not Linux, a region of fewer threads: none is moved then; or the system
 * refused a thread's CPUs). */
int qvl_team_place(int threads, const int32_t* cpus, const int32_t* first, int32_t* tids) {
#if defined(__linux__) && defined(CPU_SET)
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
#else
        const int t = 0, team = 1;
#endif
        if (team != threads) {
            failed = 1;
        } else {
            cpu_set_t set;
            CPU_ZERO(&set);
            for (int32_t i = first[t]; i < first[t + 1]; i++)
                if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE) CPU_SET(cpus[i], &set);
            failed |= sched_setaffinity(0, sizeof(set), &set) != 0;
            tids[t] = (int32_t)syscall(SYS_gettid);
        }
    }
    return failed ? -1 : 0;
#else
    (void)threads, (void)cpus, (void)first, (void)tids;
    return -1;
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* One step of a wait: a pause instruction, and once the wait has gone on, the core to another thread. */
static void pause_once(int64_t* spins) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
    if (++*spins > SPINS_BEFORE_YIELD && *spins % 64 == 0) sched_yield();
}

static void fail(Team* tm, int status) {
    int none = 0;
    __atomic_compare_exchange_n(&tm->status, &none, status, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}

/* The next item of job j for thread w: the front of its own share, else (steal) the back of
 * the next share that has one. -1: none left; -2: the job is over (the thread is behind). */
static int64_t take(const Walker* w, int64_t j, int64_t items, int steal) {
    Team* tm = w->team;
    const int T = tm->threads;
    for (int i = 0; i < (steal ? T : 1); i++) {
        const int s = (w->t + i) % T;
        int64_t lo, hi;
        team_share(items, T, s, &lo, &hi);
        int64_t v = __atomic_load_n(&tm->shares[s].word, __ATOMIC_RELAXED);
        for (;;) {
            const int64_t vj = (int64_t)((uint64_t)v >> 32);
            if (vj > j) return -2;
            const int64_t front = vj == j ? (v >> 16) & MAX_SHARE : 0, back = vj == j ? v & MAX_SHARE : 0;
            if (front + back >= hi - lo) break;
            const int64_t taken = (int64_t)((uint64_t)j << 32) | (front + (i == 0)) << 16 | (back + (i > 0));
            if (__atomic_compare_exchange_n(&tm->shares[s].word, &v, taken, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
                return i == 0 ? lo + front : hi - 1 - back;
        }
    }
    return -1;
}

/* Item `index` of job j: computed (into the thread's own buffer for a takeover job, then
 * committed unless another thread committed it first), and counted done. */
static void do_item(Walker* w, const TeamJob* job, int64_t j, int64_t index, int64_t next, const int64_t* watch) {
    Team* tm = w->team;
    const TeamItem it = {index, next, w->own, watch, j};
    if (!job->takeover) {
        const int status = job->run(job->ctx, &it);
        if (status) fail(tm, status);
        __atomic_add_fetch(&tm->committed, 1, __ATOMIC_RELEASE);
        return;
    }
    int64_t* state = &tm->item_state[index];
    if ((__atomic_load_n(state, __ATOMIC_ACQUIRE) >> 2) >= j) return; /* committed, or being committed */
    const int status = job->run(job->ctx, &it);
    if (status) fail(tm, status); /* committed all the same: the job ends, the program stops */
    int64_t s = __atomic_load_n(state, __ATOMIC_ACQUIRE);
    do {
        if ((s >> 2) >= j) return; /* another thread's result is (being) committed: this one is dropped */
    } while (!__atomic_compare_exchange_n(state, &s, j << 2 | 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    job->commit(job->ctx, &it);
    __atomic_store_n(state, j << 2 | 2, __ATOMIC_RELEASE);
    __atomic_add_fetch(&tm->committed, 1, __ATOMIC_RELEASE);
}

/* Wait for job j's items (target: `committed` once they are done); in a takeover job, compute
 * the first item not yet committed once the wait has lasted `grace` ns. */
static void wait_job(Walker* w, const TeamJob* job, int64_t j, int64_t target, int64_t grace) {
    Team* tm = w->team;
    int64_t spins = 0, since = job->takeover ? now_ns() : 0;
    while (__atomic_load_n(&tm->committed, __ATOMIC_ACQUIRE) < target) {
        if (job->takeover && spins % 64 == 63 && now_ns() - since > grace) {
            for (int64_t i = 0; i < job->items; i++) {
                const int64_t* state = &tm->item_state[i];
                if ((__atomic_load_n(state, __ATOMIC_ACQUIRE) >> 2) < j) {
                    do_item(w, job, j, i, -1, state);
                    __atomic_add_fetch(&tm->taken_over, 1, __ATOMIC_RELAXED);
                    break;
                }
            }
            since = now_ns(), spins = 0;
            continue;
        }
        pause_once(&spins);
    }
}

int team_run(Walker* w, const TeamJob* job) {
    Team* tm = w->team;
    const int64_t j = ++w->job, target = (w->done += job->items);
    int status = __atomic_load_n(&tm->status, __ATOMIC_ACQUIRE);
    if (status) return status; /* every thread stops at the job after a failure */
    if ((job->takeover && job->items > tm->capacity) || job->items > MAX_SHARE * (int64_t)tm->threads) {
        fail(tm, -2);
        return -2;
    }
    if (__atomic_load_n(&tm->committed, __ATOMIC_ACQUIRE) >= target) return tm->status; /* done while behind */
    int64_t cur = take(w, j, job->items, 1), computed = 0;
    const int64_t began = job->takeover && cur >= 0 ? now_ns() : 0; /* the items' time as one span: one clock read */
    while (cur >= 0) {
        const int64_t next = take(w, j, job->items, 0); /* its own share's next, asked from memory under this one */
        do_item(w, job, j, cur, next >= 0 ? next : -1, NULL);
        computed++;
        cur = next >= 0 ? next : next == -1 ? take(w, j, job->items, 1) : -2;
    }
    const int64_t typical = job->takeover && computed ? 2 * (now_ns() - began) / computed : 0;
    wait_job(w, job, j, target, typical > LEAST_GRACE_NS ? typical : LEAST_GRACE_NS);
    return __atomic_load_n(&tm->status, __ATOMIC_ACQUIRE);
}

typedef struct {
    int (*fn)(const void*);
    const void* ctx;
} Serial;

static int run_serial(const void* ctx, const TeamItem* it) {
    (void)it;
    const Serial* s = (const Serial*)ctx;
    return s->fn(s->ctx);
}

int team_serial(Walker* w, int (*fn)(const void* ctx), const void* ctx) {
    const Serial s = {fn, ctx};
    const TeamJob job = {1, 0, run_serial, NULL, &s};
    return team_run(w, &job);
}

int team_one_job(Walker* w, const void* job) { return team_run(w, (const TeamJob*)job); }

int team_region(int threads, int64_t capacity, int64_t own_floats, int (*program)(Walker* w, const void* ctx),
                const void* ctx, int64_t* taken_over) {
#ifdef _OPENMP
    const int T = threads < 1 ? 1 : threads;
#else
    (void)threads;
    const int T = 1;
#endif
    Team tm = {0};
    tm.threads = T, tm.capacity = capacity, tm.own_floats = own_floats;
    tm.item_state = calloc((size_t)(capacity > 0 ? capacity : 1), sizeof(int64_t));
    tm.shares = aligned_alloc(64, (size_t)T * sizeof(TeamShare));
    tm.own = malloc((size_t)(T * (own_floats > 0 ? own_floats : 1)) * sizeof(float));
    if (!tm.item_state || !tm.shares || !tm.own) {
        free(tm.item_state), free(tm.shares), free(tm.own);
        return -1;
    }
    memset(tm.shares, 0, (size_t)T * sizeof(TeamShare));
#pragma omp parallel num_threads(T)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num();
#else
        const int t = 0;
#endif
        Walker w = {&tm, t, 0, 0, tm.own + t * own_floats};
        program(&w, ctx);
        qvl_thread_done();
    }
    __atomic_add_fetch(&counts[0], tm.committed, __ATOMIC_RELAXED);
    __atomic_add_fetch(&counts[1], tm.taken_over, __ATOMIC_RELAXED);
    if (taken_over) *taken_over += tm.taken_over;
    free(tm.item_state), free(tm.shares), free(tm.own);
    return tm.status;
}

/* ---- a check of the sharing itself (tests/test_threads.py) ---------------------------------- */

typedef struct {
    int64_t *commits, *results;
    int stall_ms, takeover;
    int64_t stalled; /* set by the first thread to reach item 0 */
} Check;

static int check_run(const void* ctx, const TeamItem* it) {
    Check* c = (Check*)ctx;
    int64_t none = 0;
    if (it->index == 0 && c->stall_ms > 0 &&
        __atomic_compare_exchange_n(&c->stalled, &none, 1, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
        /* a thread whose core was taken in the middle of an item: back after stall_ms, or once
         * another thread has committed the item */
        const struct timespec ms = {0, 1000000};
        for (int i = 0; i < c->stall_ms && !__atomic_load_n(&c->commits[0], __ATOMIC_RELAXED); i++)
            nanosleep(&ms, NULL);
    }
    if (c->takeover)
        it->own[0] = (float)(it->index + 1);
    else
        __atomic_add_fetch(&c->commits[it->index], 1, __ATOMIC_RELAXED), c->results[it->index] = it->index + 1;
    return 0;
}

static void check_commit(const void* ctx, const TeamItem* it) {
    Check* c = (Check*)ctx;
    __atomic_add_fetch(&c->commits[it->index], 1, __ATOMIC_RELAXED);
    c->results[it->index] = (int64_t)it->own[0];
}

typedef struct {
    const TeamJob* job;
    int jobs;
} CheckProgram;

static int check_program(Walker* w, const void* ctx) {
    const CheckProgram* p = (const CheckProgram*)ctx;
    for (int i = 0; i < p->jobs; i++)
        if (team_run(w, p->job)) return -1;
    return 0;
}

/* `jobs` jobs of `items` items on `threads` threads, the first thread to reach item 0 stopping
 * there for stall_ms (less once another thread has committed it): commits[i] counts the times
 * item i was committed (run, for in-place jobs), results[i] its last result (i + 1). Returns
 * the items taken over, or -1. */
int64_t qvl_team_check(int threads, int64_t items, int jobs, int takeover, int stall_ms, int64_t* commits,
                       int64_t* results) {
    Check c = {commits, results, stall_ms, takeover, 0};
    const TeamJob job = {items, takeover, check_run, check_commit, &c};
    const CheckProgram p = {&job, jobs};
    int64_t taken = 0;
    return team_region(threads, items, 1, check_program, &p, &taken) ? -1 : taken;
}
