"""The deployment files in deploy/ a user applies: they parse, the picker's arguments are ones
``kvroute epp`` accepts, the ports agree (InferencePool -> Service -> container -> flags), and the
endpoint sidecar's filter turns pod listings into an endpoints file the picker reads. (The Envoy
bootstrap, deploy/envoy/envoy.yaml, runs in tests/gateway/test_epp.py.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

from kvroute.cli import build_parser  # noqa: E402
from kvroute.gateway.app import read_endpoints  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def docs(name: str) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d}


def test_the_pool_names_the_picker_and_the_ports_agree(tmp_path: Path) -> None:
    pool = docs("inferencepool.yaml")["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    epp = docs("epp.yaml")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == epp["Service"]["metadata"]["name"] == epp["Deployment"]["metadata"]["name"]
    grpc = next(p for p in epp["Service"]["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert grpc["appProtocol"] == "http2"
    container = epp["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    # The container's volumes, mounted here (the parser checks the endpoints file's directory exists).
    mounts = {m["mountPath"]: tmp_path / m["name"] for m in container["volumeMounts"]}
    for d in mounts.values():
        d.mkdir()
    args = list(container["args"])
    for mount, d in mounts.items():
        args = [str(d) + x[len(mount) :] if x.startswith(mount + "/") else x for x in args]
    a = build_parser().parse_args(args)
    assert a.command == "epp" and a.grpc_port == grpc["targetPort"] == ref["port"]["number"]
    assert {p["containerPort"] for p in container["ports"]} == {a.grpc_port, a.port}
    assert container["readinessProbe"]["grpc"] == {"port": a.grpc_port, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": a.grpc_port, "service": "liveness"}
    # The pool's pods are what the sidecar lists, on the pool's port.
    sidecar = epp["Deployment"]["spec"]["template"]["spec"]["containers"][1]
    script = sidecar["command"][-1]
    label = ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items())
    assert f"-l {label}" in script and f':{pool["spec"]["targetPorts"][0]["number"]}"' in script
    # The file is on the volume the sidecar writes.
    (shared,) = sidecar["volumeMounts"]
    assert a.endpoints_file.startswith(str(tmp_path / shared["name"]) + "/")
    gw = docs("gateway.yaml")
    backend = gw["HTTPRoute"]["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )


@pytest.mark.skipif(shutil.which("awk") is None, reason="needs awk")
def test_the_sidecar_writes_ready_pods_as_an_endpoints_file(tmp_path: Path) -> None:
    script = docs("epp.yaml")["Deployment"]["spec"]["template"]["spec"]["containers"][1]["command"][-1]
    program = re.search(r"awk '([^']+)'", script)
    assert program is not None
    # What the kubectl jsonpath prints: pod IP and its Ready condition (a pending pod has no IP yet).
    listing = "10.1.0.4 True\n10.1.0.5 False\n True\n10.1.0.6 True\n"
    out = subprocess.run(["awk", program.group(1)], input=listing, capture_output=True, text=True, check=True).stdout
    path = tmp_path / "endpoints"
    path.write_text(out)
    assert read_endpoints(str(path)) == ["http://10.1.0.4:8000", "http://10.1.0.6:8000"]
