"""A task of the credentials tests of tests/test_slurm_cluster.py (run by ``python -m
jaxdist.slurm``) and tests/test_ray_cluster.py (``python -m jaxdist.launch --backend ray``):
writes what it was given (its secrets, the modes of its files) to a private file of the test,
prints only that it is ready, and waits for the test to have looked at Slurm's records.

Usage: python tests/slurm_secret_probe.py OUT_DIR GO_FILE
"""

import json
import os
import stat
import sys
import time

out_dir, go_file = sys.argv[1], sys.argv[2]
env = os.environ
config = json.loads(env["TF_CONFIG"])
task_dir = os.path.dirname(env["JAXDIST_TLS_KEY"])
with open(env["JAXDIST_TLS_KEY"]) as f:
    key_lines = [ln for ln in f.read().splitlines() if ln and not ln.startswith("-----")]
secrets = {"token": config["token"], "tls_key": key_lines}
for name in ("JAXDIST_CLUSTER_TOKEN", "JAXDIST_COORDINATOR_TOKEN",
             "JAXDIST_COORDINATOR_ANSWER_KEY"):
    if name in env:
        secrets[name] = env[name]
facts = {
    "task": config["task"],
    "cluster": config["cluster"],
    "node": env.get("SLURMD_NODENAME"),
    "procid": env.get("SLURM_PROCID"),
    "has_public_key": "JAXDIST_COORDINATOR_PUBLIC_KEY" in env,
    "dir_mode": oct(stat.S_IMODE(os.stat(task_dir).st_mode)),
    "parent_mode": oct(stat.S_IMODE(os.stat(os.path.dirname(task_dir)).st_mode)),
    "key_mode": oct(stat.S_IMODE(os.stat(env["JAXDIST_TLS_KEY"]).st_mode)),
    "files": sorted(os.listdir(task_dir)),
    "secrets": secrets,
}
task = config["task"]
path = os.path.join(out_dir, f"probe-{env.get('SLURM_PROCID') or task['type']}.json")
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
with os.fdopen(fd, "w") as f:
    json.dump(facts, f)
print(f"probe {config['task']['type']}:{config['task']['index']} ready", flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(go_file) and time.monotonic() < deadline:
    time.sleep(0.2)
sys.exit(0 if os.path.exists(go_file) else 1)
