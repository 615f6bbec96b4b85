"""The product path for real: gRPC router → Ray prefill actor → UCX → Ray decode actor with
EAGLE-3 → gRPC stream, against the engine's own colocated output."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

pytest.importorskip("ray")
pytest.importorskip("ucxx")

from cluster.soak import settled_stats  # noqa: E402
from engine import SamplingParams  # noqa: E402
from tandem_client import Client  # noqa: E402
from tandem_client.errors import InvalidArgumentError  # noqa: E402
from tests.helpers import background  # noqa: E402


@pytest.fixture(scope="module")
def cluster(served_cluster):
    # Checksums on: the transfer section's keywords reach the actors' transports.
    return served_cluster.cluster, served_cluster.target


def colocated(engine, prompts, **params) -> Future:
    """The engine's own outputs of `prompts` (no prefix caching, as the actors run), computed
    on a thread of their own: the test's requests to the cluster go on meanwhile."""
    return background(engine.with_config(enable_prefix_caching=False).generate, prompts,
                      SamplingParams(**params))


def test_disaggregated_greedy_equals_colocated(cluster, smol_engine, chat_ids):
    import ray

    c, target = cluster
    prompts = chat_ids[:8]
    want = colocated(smol_engine, prompts, temperature=0, max_tokens=32)
    got = [None] * len(prompts)

    def run(i):
        with Client(target, timeout=300) as cl:
            got[i] = list(cl.complete(token_ids=prompts[i], temperature=0,
                                      max_tokens=32).token_ids)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in ts]
    [t.join(300) for t in ts]
    assert got == [c_.token_ids for c_ in want.result()]
    stats = ray.get([a.stats.remote() for a in c.prefills + c.decodes])
    assert all(s["blocks_free"] == s["blocks_total"] for s in stats)
    moved, paths = ray.get(c.prefills[0].__ray_call__.remote(
        lambda n: (n.transferred_bytes, n.transfer_paths)))
    assert moved > 0 and sum(paths.values()) >= len(prompts)
    assert set(paths) <= {"staged", "direct"}  # host caches in two processes: UCX messages


def test_bad_request_and_cancel_leave_nothing_behind(cluster, chat_ids):

    c, target = cluster
    with Client(target, retries=0, timeout=120) as cl:
        with pytest.raises(InvalidArgumentError):
            cl.complete(token_ids=[])
        stream = cl.generate(token_ids=chat_ids[1], temperature=0, max_tokens=200,
                             ignore_eos=True)
        n = 0
        for chunk in stream:
            n += len(chunk.token_ids)
            if n >= 4:
                stream.cancel()
                break
        assert cl.complete(token_ids=chat_ids[2], temperature=0, max_tokens=4).token_ids
    stats = settled_stats(c)
    assert all(s["blocks_free"] == s["blocks_total"] and s["running"] == 0 for s in stats)


def test_fifty_requests_with_cancellations_leak_nothing(cluster, chat_ids):
    import random


    c, target = cluster
    rng = random.Random(5)
    plans = [(rng.choice(chat_ids), rng.randrange(1, 8), rng.random() < 0.3) for _ in range(50)]

    def run(share):
        with Client(target, timeout=300) as cl:
            for ids, n, cancel in share:
                stream = cl.generate(token_ids=ids, temperature=0.5, seed=n, max_tokens=n)
                for _ in stream:
                    if cancel:
                        stream.cancel()
                        break

    ts = [threading.Thread(target=run, args=(plans[i::5],)) for i in range(5)]
    [t.start() for t in ts]
    [t.join(600) for t in ts]
    stats = settled_stats(c)
    assert all(s["blocks_free"] == s["blocks_total"] for s in stats), stats
    assert all(s["held"] == 0 and s["reserved"] == 0 and s["running"] == 0 for s in stats)


def test_node_metrics_endpoints_parse_and_move(cluster, chat_ids):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    c, target = cluster
    with Client(target, retries=0, timeout=120) as cl:  # traffic of its own: runs alone too
        assert cl.complete(token_ids=chat_ids[0], temperature=0, max_tokens=4).token_ids
    values = []
    for port in c.metrics_ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        fams = {f.name: f for f in text_string_to_metric_families(text.decode())}
        values.append({s.name: s.value for f in fams.values() for s in f.samples
                       if not s.labels.get("position") and not s.labels.get("status")})
    prefill, decode = values
    assert prefill["tandem_kv_transfer_bytes_total"] > 0
    assert prefill["tandem_kv_transfer_seconds_count"] > 0
    assert prefill["tandem_kv_transfers_total"] > 0  # by path: UCX messages on the CPU
    assert decode["tandem_kv_blocks_capacity"] > 0 and decode["tandem_spec_acceptance_length"] >= 1


# Last in this file: it kills (and Ray restarts) the module cluster's decode actor.
def test_a_stream_goes_on_when_its_decode_actor_dies(cluster, smol_engine, chat_ids):
    """Kill the decode actor mid-stream: Ray restarts it, the router moves the request (a new
    prefill, the tokens streamed so far its output) and the stream goes on. The client gets
    every token and character of the uninterrupted greedy output once, and one request's
    usage; nothing is left on either actor."""
    import os

    import ray

    c, target = cluster
    prompt, n = chat_ids[3], 32
    want = colocated(smol_engine, [prompt], temperature=0, max_tokens=n, ignore_eos=True)
    pid = lambda: ray.get(c.decodes[0].__ray_call__.remote(lambda node: os.getpid()))
    before, resumes = pid(), c.backend.resumes
    tokens, text, last, killed_at = [], "", None, None
    with Client(target, retries=0, timeout=300) as cl:
        for chunk in cl.generate(token_ids=prompt, temperature=0, max_tokens=n,
                                 ignore_eos=True):
            if killed_at is None and len(tokens) + len(chunk.token_ids) >= 8:
                killed_at = len(tokens) + len(chunk.token_ids)
                ray.kill(c.decodes[0], no_restart=False)
            tokens += chunk.token_ids
            text += chunk.text
            last = chunk
    want = want.result()[0]
    assert killed_at is not None and killed_at < n
    assert tokens == want.token_ids and text == want.text
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), n)
    assert c.backend.resumes == resumes + 1 and pid() != before  # restarted, moved once
    stats = settled_stats(c)
    assert all(s["blocks_free"] == s["blocks_total"] for s in stats), stats
    assert all(s["held"] == 0 and s["reserved"] == 0 and s["running"] == 0 for s in stats)


def test_a_request_waits_out_its_prefill_actors_restart(cluster, smol_engine, chat_ids):
    """The only prefill actor dies just before a request arrives: the request waits for Ray
    to restart it and is served, token for token as colocated."""
    import ray

    c, target = cluster
    prompt = chat_ids[4]
    want = colocated(smol_engine, [prompt], temperature=0, max_tokens=12)
    resumes = c.backend.resumes
    ray.kill(c.prefills[0], no_restart=False)
    for _ in range(100):  # until it refuses calls: the request must find it restarting
        try:
            ray.get(c.prefills[0].ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            break
        threading.Event().wait(0.1)
    else:
        pytest.fail("the killed prefill actor kept answering")
    with Client(target, retries=0, timeout=300) as cl:
        got = cl.complete(token_ids=prompt, temperature=0, max_tokens=12)
    want = want.result()[0]
    assert list(got.token_ids) == want.token_ids and got.text == want.text
    assert c.backend.resumes == resumes + 1
    stats = settled_stats(c)
    assert all(s["blocks_free"] == s["blocks_total"] for s in stats), stats
