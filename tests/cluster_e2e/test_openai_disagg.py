"""The OpenAI-compatible API over the disaggregated cluster (Ray prefill and decode actors, KV
over UCX), through the official `openai` package: gRPC's output whole and streamed, and a
client that hangs up mid-stream leaves no KV block behind on either role."""

from __future__ import annotations

import time

import pytest

from cluster import soak
from tandem_client import Client

openai = pytest.importorskip("openai")
CHAT = [{"role": "user", "content": "Give two tips for writing clear code."}]


@pytest.fixture
def api(served_cluster):
    from router.openai_http import OpenAIServer

    http = OpenAIServer(served_cluster.service)
    port = served_cluster._call(http.start("127.0.0.1", 0))
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                        max_retries=0, timeout=180)
    served_cluster._call(http.stop())


def test_openai_chat_equals_grpc_on_the_cluster(served_cluster, api):
    model = api.models.list().data[0].id
    with Client(served_cluster.target, timeout=180) as c:
        ref = c.complete(messages=CHAT, temperature=0, max_tokens=24)
    whole = api.chat.completions.create(model=model, messages=CHAT, temperature=0,
                                        max_tokens=24)
    assert whole.choices[0].message.content == ref.text
    assert whole.usage.completion_tokens == len(ref.token_ids)
    chunks = list(api.chat.completions.create(model=model, messages=CHAT, temperature=0,
                                              max_tokens=24, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_a_hang_up_mid_stream_frees_kv_on_both_roles(served_cluster, api):
    model = api.models.list().data[0].id
    stream = api.completions.create(model=model, prompt="Count to one hundred: 1, 2, 3,",
                                    max_tokens=400, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    end = time.monotonic() + 120
    while True:
        stats = soak.settled_stats(served_cluster.cluster)
        if all(s["blocks_free"] == s["blocks_total"] and s["running"] == 0 for s in stats):
            break
        assert time.monotonic() < end, stats
        time.sleep(0.1)
