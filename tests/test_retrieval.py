"""Embeddings and reranking: parity with the official method (QwenLM/Qwen3-VL-Embedding,
written here on transformers' Qwen3VLModel as its src/models do) on tiny checkpoints, the
default path close to it, the checkpoints recognised from their folders, and the scheduler
answering prefill-only requests beside generation."""

from __future__ import annotations

import functools
import json
import unicodedata

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from qvl.engine import Engine, EngineOptions, Request, RequestError
from qvl.retrieval.encode import embed, parse_embedding, rerank
from qvl.retrieval.task import EMBED, GENERATE, RERANK, model_task
from qvl.sampling import SamplingParams
from tests.reference import load_reference

REFERENCE_EMBED_INSTRUCTION = "Represent the user's input."
REFERENCE_RERANK_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."
REFERENCE_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                    'Note that the answer can only be "yes" or "no".')


def noise_image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def fp32_engine(path) -> Engine:
    return Engine.load(EngineOptions(model=str(path), weights="fp32", threads=2, max_image_tokens=64))


@pytest.fixture(scope="module")
def embedding_reference(tiny_embedding_checkpoint):
    return load_reference(tiny_embedding_checkpoint)


# -- the official method, on transformers ------------------------------------------------------

def reference_content(item: dict, images: list) -> list[dict]:
    """format_model_input's user content: images, then texts; "NULL" for nothing."""
    content = [{"type": "image", "image": im} for im in item.get("images", [])]
    content += [{"type": "text", "text": t} for t in item.get("texts", [])]
    images.extend(item.get("images", []))
    return content or [{"type": "text", "text": "NULL"}]


@functools.cache
def reference_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def reference_batch(path, conversations: list[list[dict]], units_per_conv: list[list], padding_side: str) -> dict:
    """The processor's batch: the chat template with the generation prompt, each image's pad
    token repeated for its tokens, padded; pixels as qvl preprocessed them (parity-tested elsewhere)."""
    tok = reference_tokenizer(path)
    tok.padding_side = padding_side
    texts = []
    for conv, units in zip(conversations, units_per_conv):
        text = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        pieces = text.split("<|image_pad|>")
        assert len(pieces) == len(units) + 1
        text = pieces[0] + "".join("<|image_pad|>" * u.num_tokens + piece for u, piece in zip(units, pieces[1:]))
        texts.append(text)
    batch = dict(tok(texts, padding=True, return_tensors="pt"))
    batch["mm_token_type_ids"] = (batch["input_ids"] == tok.convert_tokens_to_ids("<|image_pad|>")).int()
    units = [u for us in units_per_conv for u in us]
    if units:
        batch["pixel_values"] = torch.cat([u.pixel_values for u in units])
        batch["image_grid_thw"] = torch.tensor([u.grid_thw for u in units])
    return batch


def engine_units(engine, images: list, task: str) -> list:
    """The images as the engine preprocesses them (the same budget)."""
    if not images:
        return []
    return engine.parse(Request([{"role": "user", "content": [{"type": "image", "image": im} for im in images]}]),
                        task=task).images


def reference_embeddings(path, ref, engine, items: list[dict]) -> torch.Tensor:
    """Qwen3VLEmbedder.process: right-padded batch, hidden state at the last real token, L2-normalised."""
    conversations, units = [], []
    for item in items:
        instruction = item.get("instruction")
        if instruction:
            instruction = instruction.strip()
            if instruction and not unicodedata.category(instruction[-1]).startswith("P"):
                instruction += "."
        images: list = []
        content = reference_content(item, images)
        system = [{"type": "text", "text": instruction or REFERENCE_EMBED_INSTRUCTION}]
        conversations.append([{"role": "system", "content": system}, {"role": "user", "content": content}])
        units.append(engine_units(engine, images, EMBED))
    batch = reference_batch(path, conversations, units, "right")
    with torch.no_grad():
        hidden = ref.model(**batch).last_hidden_state
    mask = batch["attention_mask"]
    last = mask.shape[1] - mask.flip(dims=[1]).argmax(dim=1) - 1
    return F.normalize(hidden[torch.arange(hidden.shape[0]), last], p=2, dim=-1)


def reference_scores(path, ref, engine, query: dict, documents: list[dict],
                     instruction: str | None = None) -> list[float]:
    """Qwen3VLReranker.process: one pair at a time, sigmoid of the last hidden state times
    lm_head's "yes" row minus its "no" row."""
    vocab = reference_tokenizer(path).get_vocab()
    weight = ref.lm_head.weight.data
    w = weight[vocab["yes"]] - weight[vocab["no"]]
    scores = []
    for doc in documents:
        images: list = []
        contents = [{"type": "text", "text": "<Instruct>: " + (instruction or REFERENCE_RERANK_INSTRUCTION)},
                    {"type": "text", "text": "<Query>:"}, *reference_content(query, images),
                    {"type": "text", "text": "\n<Document>:"}, *reference_content(doc, images)]
        conv = [{"role": "system", "content": [{"type": "text", "text": REFERENCE_SYSTEM}]},
                {"role": "user", "content": contents}]
        batch = reference_batch(path, [conv], [engine_units(engine, images, RERANK)], "left")
        with torch.no_grad():
            h = ref.model(**batch).last_hidden_state[:, -1]
        scores.append(torch.sigmoid(h @ w).item())
    return scores


def parts(item: dict) -> list[dict]:
    """The same input as qvl content parts, texts first (qvl lays them out as the reference)."""
    return [{"type": "text", "text": t} for t in item.get("texts", [])] + \
        [{"type": "image", "image": im} for im in item.get("images", [])]


EMBED_ITEMS = [
    {"texts": ["A woman playing with her dog on a beach at sunset."],
     "instruction": "Retrieve images or text relevant to the user's query"},
    {"texts": ["短い"]},
    {"images": [noise_image(120, 90, 1)]},
    {"texts": ["a caption", "and another"], "images": [noise_image(64, 100, 2), noise_image(80, 80, 3)]},
    {},
]


def test_embeddings_match_the_reference_in_float32(tiny_embedding_checkpoint, tiny_embedder, embedding_reference):
    engine, ref = tiny_embedder, embedding_reference
    theirs = torch.cat([reference_embeddings(tiny_embedding_checkpoint, ref, engine, [item]) for item in EMBED_ITEMS])
    for i, item in enumerate(EMBED_ITEMS):  # one call per instruction (the CLI's and API's unit)
        ours, _ = embed(engine, [parts(item)], item.get("instruction"))
        assert F.cosine_similarity(ours[0], theirs[i], dim=0) >= 0.99999, i
    # texts batched as the reference batches them (right padding), in one engine call
    texts = [{"texts": ["one"]}, {"texts": ["a much longer second input, padded in the reference's batch"]}]
    ours, tokens = embed(engine, [parts(t) for t in texts])
    theirs = reference_embeddings(tiny_embedding_checkpoint, ref, engine, texts)
    assert F.cosine_similarity(ours, theirs).min() >= 0.99999
    assert tokens > 0


def test_matryoshka_dimensions_are_the_leading_entries_renormalised(tiny_embedder):
    engine = tiny_embedder
    full, _ = embed(engine, [parts({"texts": ["matryoshka"]})])
    short, _ = embed(engine, [parts({"texts": ["matryoshka"]})], dimensions=32)
    assert short.shape == (1, 32)
    torch.testing.assert_close(short[0], F.normalize(full[0, :32], dim=0), atol=1e-6, rtol=0)
    with pytest.raises(RequestError) as err:
        embed(engine, [parts({"texts": ["x"]})], dimensions=engine.cfg.text.hidden_size + 1)
    assert err.value.param == "dimensions"


def test_reranker_scores_match_the_reference_in_float32(tiny_reranker_checkpoint, tiny_reranker):
    engine, ref = tiny_reranker, load_reference(tiny_reranker_checkpoint)
    query = {"texts": ["a red stamp on an invoice"]}
    documents = [{"texts": ["Invoice, March, stamped in red."]}, {"images": [noise_image(100, 70, 4)]},
                 {"texts": ["both"], "images": [noise_image(64, 64, 5)]}, {}]
    theirs = reference_scores(tiny_reranker_checkpoint, ref, engine, query, documents, "Find invoices")
    ours, _ = rerank(engine, parts(query), [parts(d) for d in documents], "Find invoices")
    assert np.abs(np.array(ours) - np.array(theirs)).max() <= 1e-5
    assert len(set(np.round(ours, 4))) > 1  # the documents score differently


def test_default_path_stays_close_to_the_reference(tiny_embedding_checkpoint, tiny_reranker_checkpoint,
                                                   embedding_reference):
    """int8 weights, the CPU's dtype, native kernels: what a user runs."""
    embedder = Engine.load(EngineOptions(model=str(tiny_embedding_checkpoint), threads=2, max_image_tokens=64))
    items = EMBED_ITEMS[1:3]
    ours, _ = embed(embedder, [parts(item) for item in items])
    theirs = reference_embeddings(tiny_embedding_checkpoint, embedding_reference, embedder, items)
    assert F.cosine_similarity(ours, theirs).min() >= 0.99
    reranker = Engine.load(EngineOptions(model=str(tiny_reranker_checkpoint), threads=2, max_image_tokens=64))
    query, docs = {"texts": ["red"]}, [{"texts": ["a red square"]}, {"images": [noise_image(90, 90, 6)]}]
    ours_scores, _ = rerank(reranker, parts(query), [parts(d) for d in docs])
    theirs_scores = reference_scores(tiny_reranker_checkpoint, load_reference(tiny_reranker_checkpoint), reranker,
                                     query, docs)
    assert np.abs(np.array(ours_scores) - np.array(theirs_scores)).max() <= 0.02


def test_checkpoints_say_what_they_are(tiny_embedding_checkpoint, tiny_reranker_checkpoint, tiny_checkpoint, tmp_path):
    assert model_task(tiny_embedding_checkpoint) == EMBED
    assert model_task(tiny_reranker_checkpoint) == RERANK
    assert model_task(tiny_checkpoint) == GENERATE
    pooling = json.loads((tiny_embedding_checkpoint / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode"] == "lasttoken"
    config = json.loads((tiny_embedding_checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"] and "rope_parameters" in config["text_config"]
    # a download without the sentence-transformers files: by its name (a hub cache folder keeps it)
    bare = tmp_path / "models--Qwen--Qwen3-VL-Reranker-2B"
    bare.mkdir()
    assert model_task(bare) == RERANK
    assert model_task(tmp_path, "Qwen/Qwen3-VL-Embedding-8B") == EMBED


def test_requests_of_the_other_task_are_refused_naming_the_model(tiny_embedder, tiny_engine):
    engine = tiny_embedder
    with pytest.raises(RequestError) as err:
        engine.parse(Request([{"role": "user", "content": "hi"}]))
    assert err.value.param == "model" and "embedding model" in str(err.value)
    with pytest.raises(RequestError) as err:
        parse_embedding(tiny_engine, [{"type": "text", "text": "hi"}])
    assert err.value.param == "model" and "chat model" in str(err.value)


def test_prefill_only_requests_run_beside_generation(tiny_engine):
    """The scheduler answers a last_hidden request after its prefill (no token decoded), while a
    generation it admitted with it decodes as it would alone."""
    from qvl.scheduler import Sequence

    chat = Request([{"role": "user", "content": "Count to five."}], SamplingParams(temperature=0, max_new_tokens=12))
    alone = tiny_engine.generate(chat)
    parsed = tiny_engine.parse(chat)
    hidden = tiny_engine.parse(chat)
    hidden.last_hidden = True
    finished: dict = {}
    tiny_engine.scheduler.submit(Sequence(parsed, lambda e: finished.setdefault("chat", e) if hasattr(e, "text") and
                                          e.__class__.__name__ == "Done" else None))
    tiny_engine.scheduler.submit(Sequence(hidden, lambda e: finished.setdefault("hidden", e)))
    while len(finished) < 2:
        tiny_engine.scheduler.step()
    assert finished["chat"].token_ids == alone.token_ids
    done = finished["hidden"]
    assert done.token_ids == [] and done.hidden.shape == (tiny_engine.cfg.text.hidden_size,)
    assert done.usage.prompt_tokens == len(parsed.ids) and done.usage.completion_tokens == 0
    assert tiny_engine.scheduler.idle


def test_cli_embed_and_rerank(tiny_embedding_checkpoint, tiny_reranker_checkpoint, tiny_embedder, capsys):
    from qvl.cli import main

    engine_args = ["--weights", "fp32", "--threads", "2", "--max-image-tokens", "64"]
    assert main(["embed", "first", "second", "-m", str(tiny_embedding_checkpoint), "--dimensions", "8",
                 *engine_args]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected, _ = embed(tiny_embedder, [parts({"texts": ["first"]}), parts({"texts": ["second"]})], dimensions=8)
    assert [line["input"] for line in lines] == ["first", "second"]
    np.testing.assert_allclose([line["embedding"] for line in lines], expected.numpy(), atol=1e-6)
    assert main(["rerank", "red", "a red square", "a blue sky", "-m", str(tiny_reranker_checkpoint), "--json",
                 "-k", "1", *engine_args]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert len(results) == 1 and results[0]["document"] in ("a red square", "a blue sky")
    assert main(["embed", "x", "-m", str(tiny_reranker_checkpoint), *engine_args]) == 1
    assert "is a reranker" in capsys.readouterr().err
