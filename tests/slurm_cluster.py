"""A throwaway Slurm cluster on localhost for tests: munged, slurmctld and two slurmd (nodes n1, n2).

Debian's slurm-wlm 22.05 runs several slurmd on one host when each is started with ``-N <node>`` and slurm.conf gives
every node its own ``Port`` and ``%n`` in the slurmd pid/spool/log paths.  Everything the cluster writes
(munge key and socket, slurm.conf, controller state, spool dirs, daemon logs) lives under one directory; nothing
under /etc is touched.  The node names resolve through ``NodeAddr=127.0.0.1`` in slurm.conf, which is what
slurm/dettrain.sbatch reads to find the head node, so /etc/hosts needs no entry.

Daemons run in the foreground as our own child processes and are stopped by their pids in ``stop()``: no systemd,
no ``pkill``.  ``stop()`` first cancels every job and waits for them to leave the queue so no job step outlives its
slurmd.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "sinfo", "scancel", "srun")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}


def _which(name: str) -> str | None:
    # daemons live in /usr/sbin, which is not on every PATH
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


def unavailable_reason() -> str | None:
    """Why a local cluster cannot start here (None when it can): needs root and the slurm-wlm + munge binaries."""
    if os.geteuid() != 0:
        return "needs root (slurmd runs jobs as any user)"
    missing = [n for n in DAEMONS + CLIENTS if _which(n) is None]
    if missing:
        return f"Slurm/munge binaries missing: {', '.join(missing)} (apt-get install -y slurm-wlm munge)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_job_id() -> int:
    """A first job id whose rendezvous port (slurm/dettrain.sbatch: 15000 + id % 16000) is free right now, so two
    test clusters on one machine (two engineers' pytest runs) do not both start at job 1 and share a port."""
    rng = random.Random()
    for _ in range(100):
        job = rng.randrange(1000, 15000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 15000 + job))
            except OSError:
                continue
        return job
    raise RuntimeError("no free port in 16000-30000 for the test jobs' rendezvous")


class SlurmCluster:
    """Start with ``start()`` (or ``with SlurmCluster(dir) as c:``); ``env`` is what client commands need."""

    def __init__(self, root: Path, nodes: tuple[str, ...] = ("n1", "n2"), cpus: int = 2) -> None:
        self.root = Path(root)
        self.nodes = nodes
        self.cpus = cpus
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / f"{name}.out", "w")
        # own session: a Ctrl-C to pytest must not reach the daemons before stop() has cancelled the jobs
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        log.close()

    def _wait(self, what: str, ok, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode} while waiting for {what}:\n"
                                       f"{self.logs()}")
            if ok():
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out waiting for {what}:\n{self.logs()}")

    def start(self) -> None:
        r = self.root
        for d in ("munge", "state", *(f"spool/{n}" for n in self.nodes)):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = r / "munge" / "munge.socket"
        self._spawn("munged", [_which("munged"), "--foreground", "--force", f"--key-file={key}",
                               f"--socket={self.munge_socket}", f"--pid-file={r / 'munge' / 'munged.pid'}",
                               f"--log-file={r / 'munge' / 'munged.log'}", f"--seed-file={r / 'munge' / 'seed'}"])
        self._wait("munged's socket", self.munge_socket.exists)

        ctld_port = _free_port()
        node_ports = [_free_port() for _ in self.nodes]
        host = socket.gethostname()
        (r / "plugstack.conf").write_text("")  # not the system's /etc/slurm/plugstack.conf
        lines = [
            "ClusterName=dettraintest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also delays a requeued job's restart (default 120 s); sched_interval is how often pending
            # jobs that became eligible are looked at (default 60 s): both shortened so a requeue takes seconds
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"SlurmdLogFile={r}/slurmd-%n.log",
            f"PlugStackConfig={r / 'plugstack.conf'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SlurmdParameters=config_overrides",  # the declared CPUs need not match this machine's
            "ReturnToService=2",
            "JobRequeue=1",
            f"FirstJobId={_first_job_id()}",
            "KillWait=30",
            "MinJobAge=3600",  # finished jobs stay visible to scontrol for the test's checks
            "MailProg=/bin/true",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        for node, port in zip(self.nodes, node_ports):
            # NodeAddr: the name resolves to this host for Slurm and for the sbatch script's head-node lookup
            lines.append(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} "
                         "State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-c", "-f", str(self.conf)])
        self._wait("slurmctld", lambda: self._run(["scontrol", "ping"], check=False).returncode == 0)
        for node in self.nodes:
            self._spawn(f"slurmd-{node}", [_which("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
        self._wait("idle nodes", lambda: self.node_states() == {n: "idle" for n in self.nodes})

    def stop(self) -> None:
        """Cancel every job, wait for the queue to drain, then stop the daemons by pid (slurmd, slurmctld, munged)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self._run(["scancel", "--full", "--signal=KILL", "--user=root"], check=False)
            self._run(["scancel", "--user=root"], check=False)
            end = time.monotonic() + 60
            while time.monotonic() < end:
                q = self._run(["squeue", "-h", "-o", "%i"], check=False)
                if q.returncode != 0 or not q.stdout.strip():
                    break
                time.sleep(0.5)
        order = [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in order:
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.procs.clear()

    # ---- client commands ------------------------------------------------------------------------------------
    def _run(self, cmd: list[str], check: bool = True, env: dict | None = None,
             cwd: Path | str | None = None) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster; ``env`` (whole environment) replaces os.environ."""
        env = {**(self.env if env is None else env), "SLURM_CONF": str(self.conf)}
        p = subprocess.run([_which(cmd[0]), *cmd[1:]], env=env, capture_output=True, text=True, timeout=60, cwd=cwd)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        return p

    def node_states(self) -> dict[str, str]:
        p = self._run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        if p.returncode != 0:
            return {}
        return dict(line.split() for line in p.stdout.splitlines() if line.strip())

    def sbatch(self, script: Path | str, *args: str, options: tuple[str, ...] = (), env: dict | None = None,
               cwd: Path | str | None = None) -> int:
        """Submit ``script`` with sbatch ``options`` and script ``args``; the job sees ``env`` (default: ours).
        Returns the job id."""
        p = self._run(["sbatch", "--parsable", *options, str(script), *args], env=env, cwd=cwd)
        return int(p.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, NodeList, ...)."""
        p = self._run(["scontrol", "show", "job", "-o", str(job_id)])
        return dict(tok.split("=", 1) for tok in p.stdout.split() if "=" in tok)

    def wait_job(self, job_id: int, pred=lambda j: j["JobState"] in TERMINAL, timeout: float = 300) -> dict[str, str]:
        """Poll until ``pred(job)`` holds; returns the job record."""
        end = time.monotonic() + timeout
        while True:
            j = self.job(job_id)
            if pred(j):
                return j
            if time.monotonic() > end:
                raise TimeoutError(f"job {job_id} still {j['JobState']} after {timeout} s:\n{self.logs()}")
            time.sleep(0.3)

    def logs(self, tail: int = 30) -> str:
        out = []
        for f in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            lines = f.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(out)
