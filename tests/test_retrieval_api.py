"""The retrieval routes in-process (fastapi TestClient over tiny embedding and reranker
engines), through real clients unchanged (openai's embeddings.create, langchain-openai's
OpenAIEmbeddings, ollama's embed) and raw HTTP: the answers are the engine's own, and bad
requests are 400s naming their field while the server keeps serving."""

from __future__ import annotations

import base64

import numpy as np
import ollama
import openai
import pytest
from fastapi.testclient import TestClient
from langchain_openai import OpenAIEmbeddings

from qvl.retrieval.encode import embed, rerank
from tests.test_retrieval import fp32_engine
from tests.test_server_api import assert_error, make_app, wait_ready
from tests.test_server_support import data_uri, png_bytes

JSON_BODY = {"Content-Type": "application/json"}


# the expected answers come from engines of their own (tiny_embedder, tiny_reranker): the server's worker
# alone drives its engine
@pytest.fixture(scope="module")
def client(tiny_embedding_checkpoint):
    with TestClient(make_app(fp32_engine(tiny_embedding_checkpoint))) as c:
        wait_ready(c)
        yield c


@pytest.fixture(scope="module")
def rerank_client(tiny_reranker_checkpoint):
    with TestClient(make_app(fp32_engine(tiny_reranker_checkpoint))) as c:
        wait_ready(c)
        yield c


def texts(*values: str) -> list[list[dict]]:
    return [[{"type": "text", "text": v}] for v in values]


def test_openai_client_embeddings_create(client, tiny_embedder):
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    got = api.embeddings.create(model="embedder", input=["a cat on a mat", "invoices from March"])  # base64 on the wire
    expected, tokens = embed(tiny_embedder, texts("a cat on a mat", "invoices from March"))
    assert [d.index for d in got.data] == [0, 1]
    np.testing.assert_allclose(np.array([d.embedding for d in got.data]), expected.numpy(), atol=1e-6)
    assert got.usage.prompt_tokens == got.usage.total_tokens == tokens
    short = api.embeddings.create(model="embedder", input="a cat on a mat", dimensions=16, encoding_format="float")
    assert len(short.data[0].embedding) == 16
    assert abs(np.linalg.norm(short.data[0].embedding) - 1) < 1e-5


def test_langchain_openai_embeddings(client, tiny_embedder):
    lc = OpenAIEmbeddings(model="embedder", base_url="http://testserver/v1", api_key="unused",
                          check_embedding_ctx_length=False, http_client=client, max_retries=0)
    documents = lc.embed_documents(["first page", "second page"])
    expected, _ = embed(tiny_embedder, texts("first page", "second page"))
    np.testing.assert_allclose(np.array(documents), expected.numpy(), atol=1e-6)
    np.testing.assert_allclose(lc.embed_query("first page"), expected[0].numpy(), atol=1e-6)


def test_ollama_client_embed(client, tiny_embedder):
    api = ollama.Client(host="http://testserver")
    api._client = client  # the client's requests go to the app in-process (its own httpx client, swapped)
    got = api.embed(model="embedder", input=["hello", "world"])
    expected, tokens = embed(tiny_embedder, texts("hello", "world"))
    np.testing.assert_allclose(np.array(got.embeddings), expected.numpy(), atol=1e-6)
    assert got.prompt_eval_count == tokens
    assert len(api.embed(model="embedder", input="hello", dimensions=8).embeddings[0]) == 8


def test_multimodal_inputs_as_content_parts_and_messages(client, tiny_embedder):
    image = png_bytes(64, 48)
    parts = [{"type": "image_url", "image_url": {"url": data_uri(image)}}, {"type": "text", "text": "a red page"}]
    expected, _ = embed(tiny_embedder, [[{"type": "image", "image": image}, {"type": "text", "text": "a red page"}]],
                        "Find the page")
    r = client.post("/v1/embeddings", json={"input": [parts], "instruction": "Find the page",
                                            "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    vector = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, expected[0].numpy(), atol=1e-6)
    # vLLM's chat form: a system message holds the instruction, the user message the input
    r = client.post("/v1/embeddings", json={"messages": [{"role": "system", "content": "Find the page"},
                                                          {"role": "user", "content": parts}]})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], expected[0].numpy(), atol=1e-6)


def test_rerank_and_score(rerank_client, tiny_reranker):
    image = png_bytes(48, 48, (10, 10, 200))
    documents = ["a red stamp on the invoice", "a blue sky", {"image": data_uri(image)},
                 {"text": "stamped", "image": data_uri(image)}]
    engine_docs = texts("a red stamp on the invoice", "a blue sky") + [
        [{"type": "image", "image": image}], [{"type": "text", "text": "stamped"}, {"type": "image", "image": image}]]
    expected, _ = rerank(tiny_reranker, texts("red stamp")[0], engine_docs)
    r = rerank_client.post("/v1/rerank", json={"model": "r", "query": "red stamp", "documents": documents, "top_n": 3})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == list(np.argsort(expected)[::-1][:3])
    assert [x["relevance_score"] for x in results] == sorted((x["relevance_score"] for x in results), reverse=True)
    for x in results:
        assert abs(x["relevance_score"] - expected[x["index"]]) < 1e-6
        assert x.get("document", {}).get("text") == (documents[x["index"]] if isinstance(documents[x["index"]], str)
                                                     else documents[x["index"]].get("text"))
    r = rerank_client.post("/v1/score", json={"text_1": "red stamp",
                                              "text_2": ["a red stamp on the invoice", "a blue sky"]})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]], expected[:2], atol=1e-6)


def test_bad_requests_name_their_field_and_the_server_keeps_serving(client, rerank_client):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    error = assert_error(client.post("/v1/chat/completions", json=chat), 400, "model", "wrong_model_task")
    assert "embedding model" in error["message"]
    assert "embedding model" in client.post("/api/chat", json={"model": "x", **chat}).json()["error"]
    assert_error(client.post("/v1/rerank", json={"query": "q", "documents": ["d"]}), 400, "model")
    assert_error(rerank_client.post("/v1/embeddings", json={"input": "x"}), 400, "model")
    assert_error(client.post("/v1/embeddings", json={"input": "x", "dimensions": 100000}), 400, "dimensions")
    assert_error(client.post("/v1/embeddings", json={"input": [[15339, 1917]]}), 400, "input")
    assert_error(client.post("/v1/embeddings", json={"input": ["ok", 3]}), 400, "input")
    broken = [[{"type": "image_url", "image_url": {"url": "data:,x"}}]]
    assert_error(client.post("/v1/embeddings", json={"input": broken}), 400, "input[0][0].image_url.url")
    assert_error(client.post("/v1/embeddings", json={}), 400, "input")
    assert_error(client.post("/v1/embeddings", json={"input": "x", "encoding_format": "int8"}), 400, "encoding_format")
    assert_error(rerank_client.post("/v1/rerank", json={"query": "q", "documents": []}), 400, "documents")
    assert_error(rerank_client.post("/v1/rerank", json={"query": "q", "documents": [7]}), 400, "documents[0]")
    assert_error(rerank_client.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}), 400, "text_1")
    assert client.post("/v1/embeddings", json={"input": "still serving"}).status_code == 200
    assert rerank_client.post("/v1/rerank", json={"query": "q", "documents": ["d"]}).status_code == 200
