"""bench/serve_bench.py's reading of the server log (the block size, and why nothing hit) and its
checks of the command line."""

import pytest

from bench import serve_against, serve_bench
from paged_prefix.vllm_plugin.platform import CONFIG_LINE, WORKER_CLS


def _line(block_size: int) -> str:
    """The platform's start-up line as vLLM's logger prints it."""
    return ("(APIServer pid=579) INFO 12-02 14:52:42 [platform.py:188] "
            + CONFIG_LINE % (WORKER_CLS, block_size, True, True))


def test_the_block_size_is_read_from_the_platforms_line(tmp_path):
    log = tmp_path / "server-on.log"
    log.write_text("INFO starting\n" + _line(1056) + "\nINFO up\n")
    assert serve_bench.block_size(log) == 1056
    log.write_text("INFO a log without the platform's line\n")
    assert serve_bench.block_size(log) is None


def test_no_hits_are_explained_only_where_the_prefix_is_shorter_than_a_block():
    reason = serve_bench.no_hit_reason(0.0, 1056, 1024)
    assert "1056" in reason and "1024" in reason and "--prefix-len 1056" in reason
    assert serve_bench.no_hit_reason(0.0, 1056, 1056) is None  # the cause is elsewhere
    assert serve_bench.no_hit_reason(0.25, 1056, 1024) is None
    assert serve_bench.no_hit_reason(0.0, None, 1024) is None


@pytest.mark.parametrize("argv, field", [
    (["--dtype", "float32"], "--dtype"),  # a --model folder keeps its own dtype
    (["--random-weights", "qwen3-next-small", "--dtype", "bfloat16"], "--dtype"),
    (["--random-weights", "llama-1b", "--prefix-len", "0"], "--prefix-len"),
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "nan"], "--request-rate"),
    (["--against", "mlx-lm", "--request-rate", "2"], "--request-rate"),
])
def test_bad_command_lines_name_the_option(argv, field):
    with pytest.raises(ValueError, match=field):
        serve_bench.parse_args(argv)


def test_a_request_rate_reaches_the_client_and_the_workload_line():
    args = serve_bench.parse_args(["--request-rate", "2.5"])
    command = serve_bench.client_command("http://h", "m", "t", args, 0, 8, "r.json")
    assert command[command.index("--request-rate") + 1] == "2.5"
    assert "2.5 requests/s (Poisson)" in serve_bench.workload_text(args)
    assert "--request-rate" not in serve_bench.client_command(
        "http://h", "m", "t", serve_bench.parse_args([]), 0, 8, "r.json")


def test_random_weights_take_the_dtype_asked_for():
    assert serve_bench.parse_args(["--random-weights", "qwen3-next-2b", "--dtype", "float32"]).dtype \
        == "float32"
    assert serve_bench.parse_args(["--random-weights", "qwen3-next-2b"]).dtype is None
    dtypes = [serve_bench.weight_dtype(serve_bench.parse_args(argv)) for argv in (
        ["--random-weights", "qwen3-next-2b"], ["--random-weights", "qwen3-next-small"],
        ["--random-weights", "llama-1b", "--dtype", "float32"], [])]
    assert dtypes == ["bfloat16", "float32", "float32", None]


@pytest.mark.parametrize(("argv", "dtype"), [(["--random-weights", "llama-1b"], "bfloat16"),
                                             (["--random-weights", "qwen3-next-2b", "--dtype",
                                               "float32"], "float32"), ([], None)])
def test_servers_serve_random_weights_in_their_dtype(monkeypatch, tmp_path, argv, dtype):
    """vLLM's --dtype auto downcasts a float32 folder to bfloat16 on a GPU platform: both the
    settings' servers and --against's are told the dtype the weights were written in."""
    started = []

    class Server:
        def __init__(self, model, server_args, log, env=None):
            started.append(server_args)

        def __enter__(self):
            raise KeyboardInterrupt  # stop before anything starts

        def __exit__(self, *exc):
            return False

    args = serve_bench.parse_args([*argv, "--out", str(tmp_path)])
    monkeypatch.setattr(serve_bench, "VllmServer", Server)
    monkeypatch.setattr(serve_against, "VllmServer", Server)
    with pytest.raises(KeyboardInterrupt):
        serve_bench.run_setting("on", "model", args)
    with pytest.raises(KeyboardInterrupt):
        serve_against.run_server("paged_prefix", "model", args)
    for options in started:
        assert (options[options.index("--dtype") + 1] if "--dtype" in options else None) == dtype
    assert len(started) == 2


def test_a_missing_matplotlib_stops_the_bench_before_any_server(monkeypatch, tmp_path):
    """The plots come last: without matplotlib the bench stops at once, not after its runs."""
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    started = []
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.setattr(serve_bench, "resolve_model", lambda args: started.append(args))
    with pytest.raises(SystemExit, match="matplotlib"):
        serve_bench.main(["--out", str(tmp_path / "out")])
    assert not started and not (tmp_path / "out").exists()
