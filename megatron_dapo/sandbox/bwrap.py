"""The bubblewrap command line of one sandbox and the user namespace it runs in.

Inside: new user, pid, network (loopback only), ipc, uts and mount namespaces; the interpreter's prefix (stdlib)
and optionally its site-packages read-only, /usr /lib /bin read-only, a fresh size-limited /tmp (the only
writable place), no environment but a few fixed variables. A small launcher sets the resource limits, drops to
uid 65534 and runs /sandbox/main.py as __main__ (`python -I`).

Root ignores RLIMIT_NPROC (the kernel exempts kuid 0), and bwrap's own `--uid` maps the sandbox's uid to the
caller's, root. So a root caller builds the user namespace itself (`--userns`): ns uid 0 -> 0 (bwrap mounts with
root's file access; /root is often 0700) and 65534 -> 65534 (the launcher's setresuid lands on a real non-root
uid, so the process cap holds), gid 65534 only; bwrap starts with gid 65534 and no supplementary groups. A
non-root caller uses bwrap's usual `--unshare-user` (the sandbox is the caller's own non-root uid outside).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo.sandbox.types import SandboxConfig, SandboxUnavailable

SANDBOX_UID = 65534  # nobody
SNIPPET = "/sandbox/main.py"
INSTALL_HINT = "apt-get update && apt-get install -y bubblewrap"
# The project itself (its code, and by convention its data and checkpoints): no bind may cover it.
PROJECT = Path(__file__).resolve().parents[2]
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
       "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # threads count as processes

# Runs as `python -I -c LAUNCHER mem cpu fsize nofile nproc uid FILE`: limits first, then the uid drop, then FILE
# as __main__ in this same interpreter (a second one would double a call's start-up); an uncaught exception's
# traceback starts at FILE's frames, as `python FILE` prints it, and exits 1.
LAUNCHER = """import os, resource as R, runpy, sys, traceback
mem, cpu, fsize, nofile, nproc, uid = map(int, sys.argv[1:7])
for lim, v in ((R.RLIMIT_AS, mem), (R.RLIMIT_FSIZE, fsize), (R.RLIMIT_NOFILE, nofile), (R.RLIMIT_NPROC, nproc),
               (R.RLIMIT_CORE, 0)):
    R.setrlimit(lim, (v, v))
R.setrlimit(R.RLIMIT_CPU, (cpu, cpu + 1))
if uid >= 0:
    os.setresuid(uid, uid, uid)
path = sys.argv[7]
sys.argv = [path]
try:
    runpy.run_path(path, run_name="__main__")
except (SystemExit, KeyboardInterrupt):
    raise
except BaseException as e:
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != path:
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb or e.__traceback__)
    sys.exit(1)
"""


@dataclass(frozen=True)
class Interpreter:
    exe: str  # real path of the binary (a pyenv shim or a venv link is resolved)
    prefix: str  # its installation (stdlib), bound read-only at the same path
    base_site: str  # where that installation's site-packages is: the place the snippet's python looks
    site: str  # the site-packages to show there ("" = none): a venv's, or the installation's own


@functools.lru_cache(maxsize=8)
def interpreter(python: str) -> Interpreter:
    """`python` ("" = this one) as the sandbox runs it: the real binary and the packages it should see."""
    probe = ("import json, os, site, sys, sysconfig; base = {'base': sys.base_prefix, 'platbase': sys.base_prefix};"
             "print(json.dumps([os.path.realpath(sys.executable), sys.base_prefix,"
             " sysconfig.get_paths(vars=base)['purelib'], sysconfig.get_paths()['purelib']]))")
    if python:
        try:
            out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60, check=True).stdout
        except (OSError, subprocess.SubprocessError) as e:
            raise SandboxUnavailable(f"sandbox: cannot run sandbox.python={python!r}: {e}") from None
        exe, prefix, base_site, site = json.loads(out)
    else:
        import sysconfig
        base = {"base": sys.base_prefix, "platbase": sys.base_prefix}
        exe, prefix = os.path.realpath(sys.executable), sys.base_prefix
        base_site, site = sysconfig.get_paths(vars=base)["purelib"], sysconfig.get_paths()["purelib"]
    return Interpreter(exe, os.path.realpath(prefix), base_site, os.path.realpath(site))


def refuse_covering(path: str) -> None:
    """A read-only bind that holds the project would show the snippet its code, data and answers."""
    p = Path(path).resolve()
    if PROJECT == p or p in PROJECT.parents:
        raise SandboxUnavailable(f"sandbox: binding {p} would expose the project at {PROJECT}; "
                                 f"use an interpreter installed outside it (sandbox.python)")


def _ancestors(path: str) -> list[str]:
    parts = Path(path).parts[1:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def mounts(cfg: SandboxConfig, interp: Interpreter) -> list[str]:
    shown = interp.site if cfg.site_packages and interp.site and os.path.isdir(interp.site) else ""
    for path in ("/usr", "/lib", "/lib64", "/bin", interp.prefix, shown):
        if path:
            refuse_covering(path)
    args = ["--ro-bind", "/usr", "/usr", "--ro-bind-try", "/lib", "/lib", "--ro-bind-try", "/lib64", "/lib64",
            "--ro-bind-try", "/bin", "/bin", "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for d in _ancestors(interp.prefix):  # bwrap copies a 0700 parent's mode (/root): the sandbox uid needs x
        args += ["--perms", "0755", "--dir", d]
    args += ["--ro-bind", interp.prefix, interp.prefix]
    if shown and not shown.startswith(interp.prefix + os.sep):
        args += ["--ro-bind", shown, interp.base_site]  # a venv's packages where the base python looks
    elif not cfg.site_packages and os.path.isdir(interp.base_site):
        args += ["--tmpfs", interp.base_site, "--remount-ro", interp.base_site]  # the installation's own, hidden
    return args + ["--proc", "/proc", "--dev", "/dev",
                   "--perms", "1777", "--size", str(cfg.disk_mb << 20), "--tmpfs", "/tmp"]


def userns_for_root() -> int:
    """A fresh user namespace (fd) mapping uid 0 -> 0 and 65534 -> 65534, gid 65534 -> 65534 (see the top)."""
    try:
        holder = subprocess.Popen(["unshare", "--user", "--", "sh", "-c", "echo; exec cat"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    except OSError as e:
        raise SandboxUnavailable(f"sandbox: cannot start `unshare` (util-linux) for the user namespace: {e}") from None
    try:
        holder.stdout.readline()  # it has unshared
        uid_map, gid_map = f"0 0 1\n{SANDBOX_UID} {SANDBOX_UID} 1\n", f"{SANDBOX_UID} {SANDBOX_UID} 1\n"
        Path(f"/proc/{holder.pid}/uid_map").write_text(uid_map)
        Path(f"/proc/{holder.pid}/gid_map").write_text(gid_map)
        return os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise SandboxUnavailable(f"sandbox: cannot create the sandbox's user namespace ({e}); run as root or "
                                 f"allow user namespaces (sysctl user.max_user_namespaces)") from None
    finally:
        holder.stdin.close()
        holder.stdout.close()
        holder.wait()


@dataclass
class Launch:
    """Everything subprocess.Popen needs for one call; `close()` releases the fds afterwards."""

    argv: list[str]
    pass_fds: tuple[int, ...]
    root: bool

    def popen_kwargs(self) -> dict:
        kw: dict = {"pass_fds": self.pass_fds, "start_new_session": True}
        if self.root:
            kw.update(group=SANDBOX_UID, extra_groups=[])
        return kw

    def close(self) -> None:
        for fd in self.pass_fds:
            os.close(fd)


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(f"sandbox: bubblewrap (bwrap) is not installed; install it: `{INSTALL_HINT}` "
                                 f"(model-written code never runs unsandboxed)")
    return path


def launch(code: str, cfg: SandboxConfig) -> Launch:
    """The bwrap command that runs `code` under `cfg`'s limits."""
    interp = interpreter(cfg.python)
    root = os.geteuid() == 0
    snippet = os.memfd_create("snippet", 0)  # no temp file on the host; bwrap copies it into the sandbox
    fds = [snippet]
    try:
        os.write(snippet, code.encode("utf-8", "surrogateescape"))
        os.lseek(snippet, 0, os.SEEK_SET)
        argv = [bwrap_path(), "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv"]
        if root:
            fds.append(userns_for_root())
            argv += ["--userns", str(fds[-1]), "--cap-add", "CAP_SETUID"]  # for the launcher's one setresuid
        else:
            argv += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        for key, value in ENV.items():
            argv += ["--setenv", key, value]
        argv += mounts(cfg, interp)
        argv += ["--perms", "0444", "--ro-bind-data", str(snippet), SNIPPET, "--chdir", "/tmp"]
        limits = [cfg.memory_mb << 20, cfg.cpu_limit_s, cfg.disk_mb << 20, cfg.max_open_files, cfg.max_processes,
                  SANDBOX_UID if root else -1]
        argv += [interp.exe, "-I", "-c", LAUNCHER, *map(str, limits), SNIPPET]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return Launch(argv, tuple(fds), root)
