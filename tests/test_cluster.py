"""Joining a run on several hosts, without starting one: addresses, cluster detection from the
environment, the coordinator's reachability, JAX's fatal runtime text turned into one line, and
the train command's join flags refused in one line before anything starts."""

from __future__ import annotations

import socket
import time

import pytest

from zbpp_lite.runtime.cluster import detect_cluster, explain_runtime_failure, parse_address, wait_for_coordinator


def test_addresses_parse_or_are_refused_with_the_form_wanted():
    assert parse_address("10.0.0.1:4321", "--coordinator") == ("10.0.0.1", 4321)
    assert parse_address("[::1]:80", "--coordinator") == ("::1", 80)
    for bad in ("10.0.0.1", "host:0", ":80", "host:http", "host:70000"):
        with pytest.raises(ValueError, match="--coordinator must be HOST:PORT"):
            parse_address(bad, "--coordinator")


SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}


@pytest.mark.parametrize("env, name", [
    ({}, None),
    ({**SLURM, "SLURM_NTASKS": "2"}, "slurm"),
    ({**SLURM, "SLURM_NTASKS": "1"}, None),  # one task: one process, as on a laptop
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, None),  # salloc without srun: no step, no detection
    ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "2"}, "ompi"),
    ({"TPU_WORKER_HOSTNAMES": "t0,t1"}, "tpu"),
    ({"TPU_WORKER_HOSTNAMES": "t0"}, None),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "0"}, "k8s"),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, None),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "jax"),
])
def test_cluster_detection_reads_the_environment_jax_reads(env, name):
    assert detect_cluster(env) == name


def test_an_unreachable_coordinator_fails_in_bounded_time_with_one_line():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"^process 1: coordinator 127.0.0.1:{port} unreachable for 1 s") as e:
        wait_for_coordinator("127.0.0.1", port, 1.0, process=1)
    assert time.monotonic() - t0 < 5 and "\n" not in str(e.value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert wait_for_coordinator("127.0.0.1", s.getsockname()[1], 1.0) < 1.0


# JAX 0.10.2's own text, as its runtime printed it in these cases (stack frames cut)
FATAL = ("F1130 17:41:44.470970    8733 client.h:80] Terminating process because the JAX distributed service detected "
         "fatal errors. This most likely indicates that another task died; see the other task logs for more details. "
         "Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: ")
LOST = FATAL + ("UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n1\nThe tasks have crashed. "
                "Check the task logs for an earlier error.\n\nRPC: /xla.coordination.CoordinationService/PollForError\n"
                "*** Check failure stack trace: ***\n    @     0x7fc4a66f0321  tsl::RPCState<>::OnCompleted()\n")
COORDINATOR_GONE = ("F1130 17:44:38.956647   10152 client.h:80] Terminating process because the JAX distributed service "
                    "detected fatal errors.\nAdditional GRPC error information from remote target coordination_service while "
                    "calling /xla.coordination.CoordinationService/PollForError:\n:UNKNOWN:Error received from peer  "
                    "{grpc_status:14, grpc_message:\"Socket closed\"}\n")
DUPLICATE = FATAL + ("ALREADY_EXISTS: Aborted connect attempt as there is a request from a newer incarnation\n\n"
                     "RPC: /xla.coordination.CoordinationService/RegisterTask\n*** Check failure stack trace: ***\n")
UNEXPECTED = FATAL + "INVALID_ARGUMENT: Unexpected task registered with task=2\n\nRPC: /xla.coordination.CoordinationService/RegisterTask\n"
TIMED_OUT = FATAL + "DEADLINE_EXCEEDED: Deadline Exceeded\n\nRPC: /xla.coordination.CoordinationService/RegisterTask\n"
STRANGER = ("F1202 06:03:54.057102    7296 socket-server.cc:299] Implement: goo.gle/debugstr    \n\n"  # JAX 0.10, one
            "*** Check failure stack trace: ***\n    @     0x7f60386f0321  (unknown)\n")  # frame of 8 zero bytes


@pytest.mark.parametrize("text, process, want", [
    (LOST, 0, "process 0: lost process 1 (no heartbeat from it)"),
    (COORDINATOR_GONE, 1, "process 1: lost process 0, the coordinator (coordinator 10.0.0.1:4321)"),
    (DUPLICATE, 1, "process 1: duplicate process id: another process registered as process 1"),
    (UNEXPECTED, 2, "process 2: the coordinator (coordinator 10.0.0.1:4321) does not expect process 2: --num-processes differs"),
    (TIMED_OUT, 0, "process 0: not every process registered with the coordinator (coordinator 10.0.0.1:4321) within 5 s"),
    (STRANGER, 1, "process 1: JAX ended it on a message to its transfer port that it could not take (socket-server.cc:299: "
                  "Implement: goo.gle/debugstr): most likely an unexpected client (a port scanner? another run?) reached "
                  "that port; these ports belong on a trusted cluster network"),
    (FATAL + "INTERNAL: something new\n", 0, "process 0: JAX's distributed runtime ended it: INTERNAL: something new"),
])
def test_jax_fatal_runtime_text_becomes_one_line_naming_the_cause(text, process, want):
    line = explain_runtime_failure(text, process, "10.0.0.1:4321", num_processes=2, timeout=5)
    assert line.startswith(want) and "\n" not in line


def test_launch_names_the_cause_of_a_childs_end_in_jaxs_runtime():
    from zbpp_lite.cli.launch import failure_line

    line = failure_line(1, -6, STRANGER.splitlines())
    assert line.startswith("process 1 ") and "process 1: JAX ended it on a message to its transfer port" in line
    assert "most likely an unexpected client" in line and "\n" not in line
    assert failure_line(1, 1, ["error: process 1: --seed: process 0 has 0, process 1 has 1"]).endswith(
        ": error: process 1: --seed: process 0 has 0, process 1 has 1")  # its own line first


def test_ordinary_errors_are_not_taken_for_runtime_failures():
    assert explain_runtime_failure("Traceback ...\nValueError: bad\n", 0, None) is None


@pytest.mark.parametrize("flags, message", [
    (["--coordinator", "127.0.0.1:1234"], "missing --num-processes, --process-id"),
    (["--coordinator", "127.0.0.1", "--num-processes", "2", "--process-id", "0"], "--coordinator must be HOST:PORT"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"], "--process-id must be in 0..1"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "3", "--process-id", "0"], "3 processes for 2 ranks"),
    (["--transfer-address", "127.0.0.2:5000"], "--transfer-address needs --coordinator"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "0", "--platform", "cpu"], "--platform is not supported"),
])
def test_bad_join_flags_are_refused_in_one_line_before_starting(flags, message, capsys, monkeypatch):
    from zbpp_lite.cli import main

    for k in ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "TPU_WORKER_HOSTNAMES", "KUBERNETES_SERVICE_HOST", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    assert main(["train", "--schedule", "1f1b", "--ranks", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_child_gets_back_the_train_flags_given():
    from zbpp_lite.cli import build_parser
    from zbpp_lite.cli.join import train_argv

    argv = ["train", "--schedule", "zb-v", "--ranks", "2", "-m", "6", "--d", "16", "--option", "a=1", "--option", "b=x",
            "--spmd", "--no-progress", "--json", "out.json", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "1"]
    args = build_parser(argv).parse_args(argv)
    again = build_parser(["train"]).parse_args(["train", *train_argv(args, args._parser)])
    for k, v in vars(args).items():
        if k not in ("coordinator", "num_processes", "process_id", "_parser"):
            assert getattr(again, k) == v, k


def test_every_setting_but_where_a_process_joins_and_writes_must_agree():
    """The roll call compares these across processes; a new train option is compared unless it is named
    per-process."""
    from zbpp_lite.cli import build_parser
    from zbpp_lite.cli.join import agreed_settings

    argv = ["train", "--schedule", "zb-v", "-m", "6", "--seed", "3", "--option", "a=1", "--json", "out.json",
            "--coordinator", "h:1", "--num-processes", "2", "--process-id", "1", "--transfer-address", "h:2"]
    args = build_parser(argv).parse_args(argv)
    settings = agreed_settings(args, args._parser)
    assert settings["--schedule"] == "zb-v" and settings["--microbatches"] == 6 and settings["--seed"] == 3
    assert settings["--option"] == ["a=1"] and settings["--blocks"] is None
    for flag in ("--ranks", "--steps", "--batch", "--d", "--heads", "--lr", "--holdout", "--max-grad-norm",
                 "--post-validation", "--spmd", "--schedule-csv", "--init"):
        assert flag in settings, flag
    for flag in ("--json", "--no-progress", "--coordinator", "--num-processes", "--process-id", "--transfer-address",
                 "--timeout", "--heartbeat", "--help"):
        assert flag not in settings, flag


def test_the_coordinator_listens_on_the_address_given_where_this_host_has_it():
    import socket

    from zbpp_lite.runtime.cluster import free_port, listen_address

    port = free_port()
    assert listen_address("127.0.0.1", port, "the coordinator port") == f"127.0.0.1:{port}"
    assert listen_address("localhost", port, "the coordinator port") in (f"127.0.0.1:{port}", f"[::1]:{port}")
    assert listen_address("192.0.2.1", port, "the coordinator port") == f"[::]:{port}"  # not this host's (NAT): all
    # a host NAME this host maps to loopback (Debian's 127.0.1.1 in /etc/hosts): the other hosts resolve it
    # to a network address, so listening on loopback alone would shut them out; every interface instead
    real = socket.getaddrinfo
    def fake(host, *a, **k):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", port))] \
            if host == "node-a" else real(host, *a, **k)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket, "getaddrinfo", fake)
        assert listen_address("node-a", port, "the coordinator port") == f"[::]:{port}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        with pytest.raises(RuntimeError, match=f"the coordinator port {port} on 127.0.0.1 cannot be listened on"):
            listen_address("127.0.0.1", port, "the coordinator port")
