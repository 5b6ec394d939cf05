"""Server configuration: defaults < the seed's environment variables < flags; validation."""

import socket

import pytest

from tokenmill.config.server import build_server_config, check_ports_free, choose_free_ports


def test_defaults_match_the_seed_script():
    c = build_server_config([], {})
    assert (c.port, c.health_port, c.grpc_port, c.metrics_port) == (9965, 8110, 8811, 8722)
    assert c.max_dec_len == 1024 and c.max_cached_task_num == 128 and c.http_workers == 1
    assert c.engine.model is None and c.model_names == ["default"]
    assert not c.disable_streaming and not c.use_warmup and c.log_dir == "log"


@pytest.mark.parametrize("field,new,old", [
    ("port", "SERVICE_HTTP_PORT", "PUSH_MODE_HTTP_PORT"),
    ("health_port", "HEALTH_HTTP_PORT", "HTTP_PORT"),
    ("grpc_port", "SERVICE_GRPC_PORT", "GRPC_PORT"),
    ("metrics_port", "METRICS_HTTP_PORT", "METRICS_PORT"),
])
def test_port_env_names_old_name_wins(field, new, old):
    assert getattr(build_server_config([], {new: "7001"}), field) == 7001
    assert getattr(build_server_config([], {old: "7002"}), field) == 7002
    assert getattr(build_server_config([], {new: "7001", old: "7002"}), field) == 7002


def test_env_values_reach_the_engine_and_flags_override_them():
    env = {"MODEL_DIR": "/models/x", "MAX_SEQ_LEN": "300", "MAX_DEC_LEN": "64",
           "BATCH_SIZE": "8", "BLOCK_SIZE": "32", "MAX_CACHED_TASK_NUM": "5",
           "DISABLE_STREAMING": "1", "USE_WARMUP": "1", "PUSH_MODE_HTTP_WORKERS": "3",
           "DTYPE": "bf16", "FD_LOG_DIR": "/tmp/tm-logs", "VLLM_API_KEY": "k"}
    c = build_server_config([], env)
    assert c.engine.model == "/models/x" and c.engine.max_num_seqs == 8
    assert c.engine.block_size == 32 and c.engine.dtype == "bfloat16"
    assert (c.max_seq_len, c.max_dec_len, c.max_cached_task_num) == (300, 64, 5)
    assert c.disable_streaming and c.use_warmup and c.http_workers == 3
    assert c.log_dir == "/tmp/tm-logs" and c.api_key == "k"
    c = build_server_config(["/other", "--max-num-seqs", "4", "--block-size", "16",
                             "--max-dec-len", "10", "--port", "1234", "--api-key", "flag",
                             "--served-model-name", "a", "b", "--max-model-len", "4k",
                             "--no-enable-prefix-caching", "--kv-cache-memory", "0.5"], env)
    assert c.engine.model == "/other" and c.engine.max_num_seqs == 4
    assert c.engine.block_size == 16 and c.max_dec_len == 10 and c.port == 1234
    assert c.api_key == "flag" and c.model_names == ["a", "b"]
    assert c.engine.max_model_len == 4000 and not c.engine.enable_prefix_caching
    assert c.engine.kv_cache_memory_gib == 0.5
    assert c.api.stream_interval == 1
    assert build_server_config(["--stream-interval", "8"], env).api.stream_interval == 8
    assert build_server_config(["--api-server-count", "4"], env).http_workers == 4  # (vLLM's)


def test_quantization_flags_and_the_seeds_int8_kv_variable():
    c = build_server_config([], {"USE_CACHE_KV_INT8": "1"})
    assert c.engine.kv_cache_dtype == "int8" and c.engine.quantization is None
    c = build_server_config(["--kv-cache-dtype", "auto", "-q", "weight_only_int4"],
                            {"USE_CACHE_KV_INT8": "1"})
    assert c.engine.kv_cache_dtype == "auto" and c.engine.quantization == "int4"
    assert build_server_config(["--quantization", "W8A8"], {}).engine.quantization == "a8w8"


def test_block_bs_sizes_the_cache_like_the_seed():
    # BLOCK_BS requests of the longest allowed length: 4 * ceil(max(1024, 2048) / 64) blocks.
    c = build_server_config([], {"BLOCK_BS": "4", "BLOCK_SIZE": "64", "MAX_SEQ_LEN": "2048"})
    assert c.engine.num_kv_blocks == 4 * 32


@pytest.mark.parametrize("argv,env,message", [
    ([], {"MAX_DEC_LEN": "lots"}, "MAX_DEC_LEN must be an integer, got 'lots'"),
    ([], {"BATCH_SIZE": "300"}, "`max_batch_size` is not allowed to exceed 256"),
    ([], {"PUSH_MODE_HTTP_WORKERS": "0"}, "PUSH_MODE_HTTP_WORKERS (0) must be between 1 and 8"),
    ([], {"PUSH_MODE_HTTP_WORKERS": "9"}, "must be between 1 and 8"),
    ([], {"DISABLE_STREAMING": "yes"}, "DISABLE_STREAMING must be 0 or 1"),
    ([], {"USE_CACHE_KV_INT8": "2"}, "USE_CACHE_KV_INT8 must be 0 or 1"),
    (["--quantization", "int3"], {}, "quantization must be one of int8, int4, a8w8, fp8"),
    ([], {"MP_NUM": "0"}, "MP_NUM / --tensor-parallel-size) must be a positive integer"),
    ([], {"MP_NUM": "two"}, "MP_NUM must be an integer"),
    (["--distributed-timeout", "0"], {}, "distributed_timeout must be > 0"),
    (["--pipeline-parallel-size", "2"], {"MP_NUM": "3"}, "MP_NUM (3) must be divisible by "
                                                         "--pipeline-parallel-size (2)"),
    ([], {"BLOCK_RATIO": "1.5"}, "BLOCK_RATIO must be in (0, 1]"),
    (["--port", "8110"], {}, "both set to port 8110"),
    (["--port", "70000"], {}, "must be a TCP port"),
    (["--max-num-seqs", "0"], {}, "max_num_seqs must be a positive integer"),
    (["--dtype", "int3"], {}, "dtype must be one of"),
    (["--max-dec-len", "0"], {}, "max_dec_len must be a positive integer"),
    (["--shutdown-timeout", "-1"], {}, "shutdown_timeout must be >= 0"),
    (["--stream-interval", "0"], {}, "stream_interval must be at least 1, got 0"),
    # the generation config's flags and vLLM's that are refused
    (["--override-generation-config", "{temperature"], {}, "is not valid JSON"),
    (["--override-generation-config", "[1]"], {}, "must be a JSON object"),
    (["--override-generation-config", '{"temprature": 1}'], {}, "unknown field(s) temprature"),
    (["--generation-config", ""], {}, "generation_config must be 'auto', 'vllm' or a folder"),
    (["--enable-reasoning"], {}, "--enable-reasoning needs --reasoning-parser"),
    (["--guided-decoding-backend", "outlines"], {}, "'outlines' is not available"),
    (["--max-logprobs", "21"], {}, "max_logprobs must be between 0 and 20, got 21"),
    (["--lora-modules", "a=/x"], {}, "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a"], {}, "--lora-modules takes NAME=PATH or JSON"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], {}, "names an adapter twice"),
    (["--enable-lora", "--lora-modules", "{bad"], {}, "is not valid JSON"),
    (["--enable-lora", "--lora-modules", '{"name": "a"}'], {}, "JSON takes \"name\", \"path\""),
    (["--enable-lora", "--served-model-name", "m", "--lora-modules", "m=/x"], {},
     "'m' is the served model's own name"),
    (["--enable-lora", "--max-lora-rank", "0"], {}, "max_lora_rank must be a positive integer"),
    (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], {},
     "max_cpu_loras (2) must be >= max_loras (4)"),
    (["--middleware", "pkg.Mw"], {}, "--middleware is refused: the server runs no code"),
    (["--hf-overrides", "{}"], {}, "--hf-overrides is refused"),
    (["--load-format", "pt"], {}, "--load-format 'pt' is not available"),
    (["--tokenizer-mode", "mistral"], {}, "--tokenizer-mode 'mistral' is not available"),
    (["--ssl-keyfile", "k.pem"], {}, "--ssl-keyfile is refused: terminate TLS in front"),
    (["--allowed-origins", "*"], {}, "--allowed-origins takes a JSON list of strings"),
])
def test_invalid_values_fail_with_a_clear_message(argv, env, message):
    with pytest.raises(ValueError) as err:
        build_server_config(argv, env)
    assert message in str(err.value)


def test_occupied_port_is_named():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = build_server_config(["--host", "127.0.0.1", "--metrics-port", str(port)], {})
        with pytest.raises(OSError, match=f"PORT: {port} occupied! Please change the port!"):
            check_ports_free(config)


@pytest.mark.parametrize("name", ["INTER_PROC_PORT", "INFER_QUEUE_PORT"])
def test_the_seed_queue_port_is_accepted_and_never_checked(name):
    """Nothing listens on the seed's queue port here (the engine link is a unix socket): the
    variable is logged as having no effect, and a port taken there stops nothing."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = build_server_config(["--host", "127.0.0.1", "--port", str(_free_port()),
                                      "--health-port", "0", "--metrics-port", "0",
                                      "--grpc-port", "0"], {name: str(port)})
        assert [flag for flag, _ in config.ignored_flags] == [name]
        check_ports_free(config)  # the queue port is taken, and that stops nothing


def _free_port() -> int:
    from tests.serving import free_port
    return free_port()


def test_ports_given_as_zero_become_distinct_free_ports():
    config = build_server_config(["--host", "127.0.0.1", "--health-port", "0",
                                  "--metrics-port", "0", "--grpc-port", "0"], {})
    check_ports_free(config)
    choose_free_ports(config)
    chosen = [config.health_port, config.metrics_port, config.grpc_port]
    assert all(chosen) and len(set(chosen + [config.port])) == 4
    with pytest.raises(ValueError, match="port must be a TCP port in 1-65535, got 0"):
        build_server_config(["--port", "0"], {})


def test_a_model_that_needs_its_own_code_is_refused_by_name(tmp_path):
    import json

    from tokenmill.loading.checkpoint import load_hf_config

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "my_custom_lm", "architectures": ["MyCustomLM"],
        "auto_map": {"AutoConfig": "configuration_my.MyConfig"}}))
    with pytest.raises(ValueError, match="needs its own Python code .* which tokenmill never "
                                         "runs, --trust-remote-code or not"):
        load_hf_config(str(tmp_path))


SEED_NODES = {"MP_NUM": "4", "MP_NNODE": "2", "POD_IPS": "10.0.0.1,10.0.0.2",
              "POD_0_IP": "10.0.0.1"}


def test_seed_node_variables_map_onto_nodes_and_ranks():
    c = build_server_config([], {**SEED_NODES, "HOST_IP": "10.0.0.2"}).engine
    assert (c.tensor_parallel_size, c.nnodes, c.node_rank, c.ranks_per_node) == (4, 2, 1, 2)
    assert (c.master_addr, c.master_port, c.node_addr) == ("10.0.0.1", 29500, "10.0.0.2")
    # an MPI launcher's rank, and flags, win over the address's place in POD_IPS
    mpi = build_server_config([], {**SEED_NODES, "HOST_IP": "10.0.0.1",
                                   "OMPI_COMM_WORLD_RANK": "1"}).engine
    assert mpi.node_rank == 1
    flags = build_server_config(["--nnodes", "2", "--node-rank", "1", "--master-addr", "h0",
                                 "--master-port", "4000", "-tp", "2"], {}).engine
    assert (flags.nnodes, flags.node_rank, flags.master_addr, flags.master_port) == \
        (2, 1, "h0", 4000)


@pytest.mark.parametrize("env,message", [
    ({"MP_NUM": "3"}, "(3) must be divisible by MP_NNODE / --nnodes (2)"),
    ({"POD_0_IP": "10.0.0.2", "HOST_IP": "10.0.0.1"}, "POD_0_IP 10.0.0.2 must be POD_IPS' first"),
    ({"HOST_IP": "10.0.0.9"}, "HOST_IP 10.0.0.9 is not in POD_IPS (10.0.0.1, 10.0.0.2)"),
    ({"POD_IPS": "10.0.0.1", "HOST_IP": "10.0.0.1"}, "POD_IPS lists 1 address(es) for "
                                                     "MP_NNODE=2"),
    ({}, "Cannot tell which POD_IPS address is this node's (none is local): set HOST_IP"),
    ({"POD_IPS": "", "POD_0_IP": ""}, "give --node-rank"),
])
def test_bad_node_variables_are_named(env, message):
    with pytest.raises(ValueError) as err:
        build_server_config([], {**SEED_NODES, **env})
    assert message in str(err.value)


def test_a_model_type_transformers_does_not_know_is_one_line(tmp_path):
    import json

    from tokenmill.loading.checkpoint import load_hf_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "my_new_lm",
                                                      "architectures": ["MyNewLM"]}))
    with pytest.raises(ValueError) as err:
        load_hf_config(str(tmp_path))
    assert "of a type transformers does not know ('my_new_lm')" in str(err.value)
    assert "LlamaForCausalLM" in str(err.value) and "\n" not in str(err.value)


def test_lora_flags():
    config = build_server_config(["--enable-lora", "--max-loras", "4", "--max-lora-rank", "64",
                                  "--max-cpu-loras", "8", "--lora-modules", "a=/x",
                                  '{"name": "b", "path": "/y", "base_model_name": "m"}'], {})
    engine = config.engine
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank,
            engine.max_cpu_loras) == (True, 4, 64, 8)
    assert engine.lora_modules == [("a", "/x", None), ("b", "/y", "m")]
    defaults = build_server_config([], {}).engine
    assert (defaults.enable_lora, defaults.max_loras, defaults.max_lora_rank,
            defaults.lora_modules) == (False, 1, 16, None)


def test_fair_share_queue_time_and_disk_tier_flags(tmp_path):
    config = build_server_config([
        "--scheduling-policy", "fair", "--tenant-weights", "gold=3,free=0.5",
        "--tenant-header", "X-Team", "--max-queue-time", "2.5",
        "--kv-cache-disk-dir", str(tmp_path), "--kv-cache-disk-gib", "3"], {})
    engine = config.engine
    assert (engine.scheduling_policy, engine.tenant_weights, engine.max_queue_time) == (
        "fair", {"gold": 3.0, "free": 0.5}, 2.5)
    assert (engine.kv_cache_disk_dir, engine.kv_cache_disk_gib) == (str(tmp_path), 3.0)
    assert config.api.tenant_header == "X-Team"
    defaults = build_server_config([], {})
    assert (defaults.engine.tenant_weights, defaults.engine.max_queue_time,
            defaults.engine.kv_cache_disk_dir, defaults.api.tenant_header) == (
        {}, None, None, "X-Tenant-Id")
    for flags, word in ((["--tenant-weights", "gold=3"], "needs --scheduling-policy fair"),
                        (["--tenant-header", "X Team"], "--tenant-header"),
                        (["--max-queue-time", "0"], "max_queue_time")):
        with pytest.raises(ValueError, match=word):
            build_server_config(flags, {})


def test_kv_offloading_and_transfer_flags():
    config = build_server_config([
        "--kv-offloading-size", "2.5", "--kv-offloading-backend", "native",
        "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'], {})
    engine = config.engine
    assert (engine.kv_offloading_size, engine.kv_offloading_backend) == (2.5, "native")
    assert engine.kv_transfer_config.kv_role == "kv_producer"
    defaults = build_server_config([], {}).engine
    assert (defaults.kv_offloading_size, defaults.kv_transfer_config) == (None, None)
    with pytest.raises(ValueError, match="kv_role"):
        build_server_config(["--kv-transfer-config", '{"kv_role":"both"}'], {})
