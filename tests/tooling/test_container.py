"""sluice in a real local Envoy container, run the way
examples/compose/docker-compose.yaml runs it (its image name, working_dir,
command and volumes, read from the file by scripts/container.py, which
`make run-container` uses too), in a private Docker daemon with host
networking. Skipped only where that daemon cannot start (not root)."""

import os
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harness import ROOT, WASM, assert_demo_limit, free_port, port_free

sys.path.insert(0, str(ROOT / "scripts"))
import container  # noqa: E402
import demo  # noqa: E402


def processes_mentioning(text):
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            pass
    return found


def test_run_args_follow_the_compose_file(tmp_path):
    """What the containers get is what the compose file says, with only the
    configuration files swapped for rendered copies at the same paths and
    the base id set."""
    services = container.compose_services()
    assert set(services) == set(container.SERVICES)
    rendered = demo.render(tmp_path, dict(demo.DEFAULTS))
    for name, svc in services.items():
        args = container.run_args(svc, rendered, base_id=4242)
        image_at = args.index(svc["image"])
        opts, command = args[:image_at], args[image_at + 1:]
        assert opts[:4] == ["--network", "host", "-w", svc["working_dir"]]
        mounts = [opts[i + 1] for i, a in enumerate(opts) if a == "-v"]
        assert [m.split(":")[1] for m in mounts] == [c for _, c, _ in svc["volumes"]]
        for m, (host, cpath, mode) in zip(mounts, svc["volumes"]):
            src = Path(m.split(":")[0])
            if Path(host).name in demo.FILES:
                assert src == rendered / Path(host).name
            else:
                assert src == (container.COMPOSE.parent / host).resolve()
            assert m.endswith(":" + mode)
        expected = list(svc["command"])
        expected[expected.index("--base-id") + 1] = "4242"
        assert command == expected
    # The wasm is mounted where envoy/envoy.yaml looks for it, relative to
    # the working directory.
    front = services["envoy"]
    wasm_in_container = f"{front['working_dir']}/{WASM.relative_to(ROOT)}"
    assert wasm_in_container in [c for _, c, _ in front["volumes"]]
    assert str(WASM.relative_to(ROOT)) in (ROOT / "envoy/envoy.yaml").read_text()


def test_compose_reader_refuses_what_it_does_not_run(tmp_path):
    text = container.COMPOSE.read_text()
    for extra in ["    ports: [\"10000:10000\"]\n", "    environment:\n    - A=1\n"]:
        bad = tmp_path / "docker-compose.yaml"
        bad.write_text(text.replace("    network_mode: host\n", "    network_mode: host\n" + extra, 1))
        with pytest.raises(ValueError):
            container.compose_services(bad)


def test_sluice_in_a_local_envoy_container():
    ports = {}
    while len(set(ports.values())) < 4:
        ports = {var: free_port() for var, _, _ in demo.PORTS}
    demo.check_free(ports)
    started = time.time()
    daemon = container.Daemon()
    try:
        daemon.__enter__()
    except container.DaemonUnavailable as e:
        pytest.skip(f"the Docker daemon cannot start here: {e}")
    try:
        services = container.compose_services()
        with container.Demo(daemon, ports, prefix="sluice-test") as d:
            ready_s = time.time() - started
            # The containers are what the compose file describes.
            for name, c in zip(d.order(), d.started):
                svc = services[name]
                info = daemon.docker("inspect", "-f",
                                     "{{.Config.Image}}|{{.Config.WorkingDir}}|{{.HostConfig.NetworkMode}}|"
                                     "{{range .Mounts}}{{.Destination}},{{end}}|{{json .Args}}", c).stdout.strip()
                image, workdir, network, mounts, args = info.split("|", 4)
                assert image == svc["image"] and workdir == svc["working_dir"] and network == "host", info
                assert sorted(filter(None, mounts.split(","))) == sorted(p for _, p, _ in svc["volumes"]), info
                assert f'"--base-id","{ports[container.SERVICES[name]]}"' in args, info

            # The demo limit through the container.
            assert_demo_limit(ports["PORT"], ports["ADMIN_PORT"])

            # It is the container that answers: stopped, nothing does.
            daemon.docker("stop", "-t", "5", d.started[-1], timeout=60)
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", ports["PORT"]), timeout=2).close()
        print(f"container test: ready after {ready_s:.1f}s")
    finally:
        daemon.__exit__()
    took = time.time() - started
    print(f"container test: {took:.1f}s in all")

    # Everything is gone: daemon, its mounts (netns/default included) and
    # files, the containers' processes; the ports are free again.
    assert daemon.proc.poll() is not None
    assert not daemon.dir.exists(), daemon.dir
    assert daemon.mounts() == []
    assert processes_mentioning(str(daemon.dir)) == []
    for var, port in ports.items():
        assert port_free(port), f"{var} {port} still bound"
    assert not os.path.exists(d.dir)
