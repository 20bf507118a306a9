"""Rollout routes over SGLang's wire (return_routed_experts): the /generate body asks for every position's routes
from 0, the answer's meta_info["routed_experts"] (base64 of int32 [positions, layers, top_k], as SGLang's
detokenizer encodes it) becomes Sample.routes, cut with the response at a client-side stop. The `sglang` test holds
our body and our decoding to SGLang's own request structure and decoder."""

from __future__ import annotations

import base64
import json
import subprocess

import numpy as np
import pytest
import torch

from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.sglang.launch import launch_command
from megatron_dapo.rollout.sglang.wire import (
    ROUTES_FLAG,
    RouteShape,
    cut_at_stop,
    generate_body,
    parse_generate_response,
    route_shape,
)

SHAPE = RouteShape(layers=3, top_k=2, num_experts=8)


def _encoded(routes: np.ndarray) -> str:
    """SGLang's encoding (detokenizer_manager._b64_encode_per_request): the int32 tensor's bytes, base64."""
    return base64.b64encode(routes.astype(np.int32).tobytes()).decode("utf-8")


def _item(prompt_len: int, out_ids: list[int], routes: np.ndarray | None) -> dict:
    meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, t, None] for t in out_ids]}
    if routes is not None:
        meta["routed_experts"] = _encoded(routes)
    return {"output_ids": out_ids, "meta_info": meta}


def test_the_body_asks_for_routes_only_when_told():
    body, _, _ = generate_body([[1, 2, 3]], 2, SamplingParams(max_new_tokens=4, seed=1, return_routes=True))
    assert body["return_routed_experts"] is True and body["routed_experts_start_len"] == 0
    plain, _, _ = generate_body([[1, 2, 3]], 2, SamplingParams(max_new_tokens=4, seed=1))
    assert "return_routed_experts" not in plain and "routed_experts_start_len" not in plain


def test_routes_decode_per_position_and_follow_a_client_side_stop():
    rng = np.random.default_rng(0)
    routes = rng.integers(0, 8, size=(3 + 5 - 1, 3, 2))
    [s] = parse_generate_response([_item(3, [4, 5, 6, 7, 8], routes)], [[1, 2, 3]], routes=SHAPE)
    assert s.routes is not None and s.routes.dtype == torch.uint8
    assert torch.equal(s.routes.long(), torch.from_numpy(routes))
    cut = cut_at_stop(s, {6})  # stop at the third response token: positions 0 .. prompt + 3 - 2
    assert cut.response_ids == [4, 5, 6] and torch.equal(cut.routes.long(), torch.from_numpy(routes[:5]))
    [plain] = parse_generate_response([_item(3, [4, 5], None)], [[1, 2, 3]])
    assert plain.routes is None


@pytest.mark.parametrize("routes, match", [(None, "no routed_experts"), (np.zeros((5, 3, 2)), "5 x 3 .*|30 routed"),
                                           (np.full((7, 3, 2), 8), "outside")])
def test_a_malformed_answer_is_refused(routes, match):
    payload = [_item(3, [4, 5, 6, 7, 8], routes)]
    with pytest.raises(ValueError, match="request 0|" + match):
        parse_generate_response(payload, [[1, 2, 3]], routes=SHAPE)


def test_the_shape_comes_from_config_json_and_the_server_flag_from_r3():
    assert route_shape({"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2}) == RouteShape(4, 2, 8)
    assert route_shape({"num_hidden_layers": 4}) is None  # dense

    from types import SimpleNamespace

    from megatron_dapo.config import SGLangConfig

    server = SimpleNamespace(device="cpu", deterministic=False, return_routes=True, api_key=None, server_index=0,
                             host="127.0.0.1", port=30000, model_path="/m", python="python", threads=None,
                             cfg=SGLangConfig())
    assert ROUTES_FLAG in launch_command(server, "float32", False, None, ())
    server.return_routes = False
    assert ROUTES_FLAG not in launch_command(server, "float32", False, None, ())


SGLANG_CHECK = r"""
import base64, json, sys
import numpy as np
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info
body = json.loads(sys.argv[1])
req = GenerateReqInput(**body)
req.normalize_batch_and_arguments()
flat = extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": sys.argv[2]}})
print(json.dumps({"return_routed_experts": req.return_routed_experts,
                  "start": req.routed_experts_start_len, "batch": req.batch_size, "flat": flat.tolist()}))
"""


@pytest.mark.sglang
def test_sglang_takes_our_body_and_decodes_our_routes_as_we_do(sglang_python):
    body, _, _ = generate_body([[1, 2, 3], [4, 5]], 2, SamplingParams(max_new_tokens=4, seed=1, return_routes=True))
    routes = np.random.default_rng(1).integers(0, 8, size=(6, 3, 2))
    r = subprocess.run([sglang_python, "-c", SGLANG_CHECK, json.dumps(body), _encoded(routes)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["return_routed_experts"] in (True, [True] * 4) and got["start"] in (0, [0] * 4) and got["batch"] == 4
    [s] = parse_generate_response([_item(3, [4, 5, 6, 7], routes)], [[1, 2, 3]], routes=SHAPE)
    assert s.routes.flatten().tolist() == got["flat"]


class _Server:
    """What SGLangStream uses of a server, answering /generate with `answer(body)`."""

    url, vocab_size = "http://fake:1", 100

    def __init__(self, answer) -> None:
        self.answer = answer
        self.bodies: list[dict] = []

    def post(self, path, body):
        self.bodies.append(body)
        return self.answer(body)

    def routes_of(self, sampling):
        return SHAPE if sampling.return_routes else None

    def dead_reason(self):
        return None


def test_a_continued_sample_keeps_its_carried_routes_and_takes_the_servers_for_the_rest():
    """Partial rollout with r3 on SGLang: the continuation reads prompt + response so far and the server routes every
    position from 0; the positions before the last carried token keep the routes that came with the carried sample,
    the rest are the server's. An aborted request's routes come back with it (here: the second call, cut short)."""
    from megatron_dapo.rollout.base import GroupRequest
    from megatron_dapo.rollout.sglang.stream import SGLangStream
    from megatron_dapo.types import Sample

    rng = np.random.default_rng(2)
    fresh = rng.integers(0, 8, size=(7, 3, 2))  # prompt 3 + carried 2 + new 3, less one

    def answer(body):
        [ids] = body["input_ids"]
        assert ids == [1, 2, 3, 4, 5] and body["return_routed_experts"] and body["routed_experts_start_len"] == 0
        return [_item(5, [6, 7, 8], fresh)]

    before = Sample([1, 2, 3], [4, 5], [-0.1, -0.2], "abort", routes=torch.full((4, 3, 2), 7, dtype=torch.uint8))
    done = Sample([1, 2, 3], [9, 9, 9, 9, 9], [-0.3] * 5, "length", routes=torch.zeros((7, 3, 2), dtype=torch.uint8))
    sampling = SamplingParams(max_new_tokens=5, seed=3, return_routes=True)
    stream = SGLangStream(_Server(answer), concurrency=1)  # type: ignore[arg-type]
    stream.submit([GroupRequest(key=0, prompt_ids=[1, 2, 3], n=2, sampling=sampling, resume=(before, done))])
    got = stream.next().samples
    stream.close()
    assert got[0].response_ids == [4, 5, 6, 7, 8] and got[0].prompt_ids == [1, 2, 3]
    assert got[0].routes.dtype == torch.uint8 and got[0].routes.shape == (7, 3, 2)
    assert torch.equal(got[0].routes[:4], before.routes) and got[0].routes[4:].tolist() == fresh[4:].tolist()
    assert torch.equal(got[1].routes, done.routes)

    item = _item(3, [4, 5], fresh[:4])
    item["meta_info"]["finish_reason"] = {"type": "abort"}
    [cut] = parse_generate_response([item], [[1, 2, 3]], aborted_ok=True, routes=SHAPE)
    assert cut.finish_reason == "abort" and cut.routes.tolist() == fresh[:4].tolist()
    del item["meta_info"]["routed_experts"]  # where a server sends none for an aborted request, the continuation's
    assert parse_generate_response([item], [[1, 2, 3]], aborted_ok=True, routes=SHAPE)[0].routes is None
