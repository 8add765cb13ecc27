"""Prompt tokens per prefill step for a request running alone (scheduler.PREFILL_TOKENS_ALONE),
A/B in one run: a 30 s 1280x720 clip's first token (1,114 prompt tokens, the 2B int8 default
path, caches off), fresh processes, the sides alternating, 3 rounds.

    python benchmarks/prefill_steps.py   # clip: benchmarks/video.py writes it into /work/ckpt/clips
"""
import sys, time, json, subprocess
code = r'''
import sys, time
import qvl.scheduler as s
s.PREFILL_TOKENS_ALONE = int(sys.argv[1])
from qvl.engine import Engine, EngineOptions, Request
from qvl.sampling import SamplingParams
from qvl.processing.video import VideoSettings
e = Engine.load(EngineOptions(model="/work/ckpt/qvl-2b", threads=2, vision_cache_mb=0, prefix_cache_mb=0, answer_cache_entries=0, clip_cache_mb=0))
e.warm_up()
r = Request([{"role":"user","content":[{"type":"video","video":"/work/ckpt/clips/synthetic-1280x720-30fps-30s.mp4"},{"type":"text","text":"Describe this clip."}]}], SamplingParams(temperature=0, max_new_tokens=1))
t = time.perf_counter(); d = e.generate(r); print(time.perf_counter() - t, d.timings.prefill_ms)
'''
res = {512: [], 2048: []}
for rnd in range(3):
    for chunk in ((512, 2048) if rnd % 2 == 0 else (2048, 512)):
        out = subprocess.run([sys.executable, "-c", code, str(chunk)], capture_output=True, text=True).stdout.split()
        res[chunk].append((float(out[0]), float(out[1]) / 1000))
        print(chunk, out, flush=True)
import statistics
for c, v in res.items():
    print(c, "ttft median", statistics.median(x for x, _ in v), "prefill median", statistics.median(y for _, y in v))
