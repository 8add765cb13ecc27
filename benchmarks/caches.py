"""What the caches save on the 2B shape: a second question about the same image, follow-up
turns (TTFT against the number of new tokens), and an exact repeat through the server.

    python benchmarks/caches.py --model /work/ckpt/qvl-2b
"""

from __future__ import annotations

import argparse
import time

from qvl.bench import synthetic_image
from qvl.engine import Engine, EngineOptions, Request
from qvl.sampling import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--image-tokens", type=int, default=None, help="default: the engine's default budget")
    args = p.parse_args()
    options = EngineOptions(model=args.model, threads=2)
    if args.image_tokens:
        options = EngineOptions(model=args.model, threads=2, max_image_tokens=args.image_tokens)
    engine = Engine.load(options)
    image = synthetic_image(1920, 1080)
    greedy = SamplingParams(temperature=0, max_new_tokens=8)

    def ask(question: str, history=()):
        first = {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}
        return engine.generate(Request([first, *history], greedy))

    first = ask("Describe this image.")
    second = ask("What colours dominate the picture?")
    print(f"image tokens {first.usage.image_tokens}, prompt {first.usage.prompt_tokens} tokens\n")
    print("| request | TTFT ms | reused prompt tokens | cached |\n|---|---|---|---|")
    print(f"| first question | {first.timings.ttft_ms:.0f} | 0 | {first.timings.cached} |")
    print(f"| second, different question, same image | {second.timings.ttft_ms:.0f} | "
          f"{second.timings.reused_tokens} | {second.timings.cached} |")
    print(f"\nsecond / first TTFT = {second.timings.ttft_ms / first.timings.ttft_ms:.3f}\n")
    print("| follow-up turn | new prompt tokens | TTFT ms |\n|---|---|---|")
    history, previous = [], second
    for words in (2, 20, 80, 200):
        history = [*history, {"role": "assistant", "content": previous.text},
                   {"role": "user", "content": " ".join(["more"] * words)}]
        previous = ask("What colours dominate the picture?", history)
        new = previous.usage.prompt_tokens - previous.timings.reused_tokens
        print(f"| {len(history) // 2} | {new} | {previous.timings.ttft_ms:.0f} |", flush=True)
    from fastapi.testclient import TestClient

    from qvl.server.app import create_app
    from qvl.server.settings import ServerSettings

    with TestClient(create_app(ServerSettings(), lambda: engine)) as client:
        while client.get("/health").status_code != 200:
            time.sleep(0.1)
        body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
        client.post("/v1/chat/completions", json=body)
        times = []
        for _ in range(10):
            started = time.perf_counter()
            response = client.post("/v1/chat/completions", json=body)
            times.append((time.perf_counter() - started) * 1000)
            assert response.status_code == 200
        times.sort()
        print(f"\nexact repeat through the server (in-process ASGI client): median {times[5]:.1f} ms, "
              f"max {times[-1]:.1f} ms over 10 requests")


if __name__ == "__main__":
    main()
