"""Run untrusted Python (model-written solutions) against tests, contained, with a verdict the
solution cannot forge.

**Two processes per run.** The *solution process* (:mod:`sandbox_child`, serving with
:mod:`sandbox_server`) is the only place untrusted code runs. The *judge process*
(:mod:`sandbox_judge`) runs the prompt's tests and reaches the solution only over a pipe pair
(:mod:`sandbox_wire`): it asks for module attributes, calls, attribute reads, iteration, or a
run of the whole program on one stdin, and gets back **plain data** (None, bool, int, float,
complex, str, bytes and lists/tuples/dicts/sets of them, plus a few stdlib value types; the
sender picks them by exact type, the judge rebuilds them from their parts) or opaque handles
(:mod:`sandbox_remote`). So ``assert candidate(x) == y`` compares two of the judge's own objects
with the judge's ``==``: that is the defence against an ``__eq__`` that always says yes (and
``int`` subclasses, ``__repr__``/``__del__`` that raise, ``abs(f(x) - y) < eps`` answered by a
``__sub__``). The solution process never sees the tests or the expected outputs. The judge
writes the verdict on a pipe only it holds; a run passes only when that verdict says every test
passed (and the solution process reported the layers it was confined with).

**Threat model.** The solution is hostile and may do anything inside its process, native code
included: patch ``json``/``os.write``/builtins or this runner's code, walk frames, install
signal handlers, exit early (``sys.exit(0)``, ``os._exit(0)``), print or write fake verdicts
on every descriptor, raise SystemExit/KeyboardInterrupt/BaseException anywhere, try to kill the
parent, fork, open sockets, read the host's files or fill the disk. None of it yields a pass,
because everything that decides the verdict lives in another process it cannot reach. The
dataset's tests are trusted not to be hostile, but the judge is confined too (rlimits, landlock,
seccomp). Layers of the solution process, outermost first:

* **Namespaces** (``unshare``; as root, else inside a user namespace): new network (only a
  downed loopback), PID (it sees only itself: the judge and the parent have no PID there,
  ``kill(-1)`` reaches nothing), mount, IPC and UTS namespaces, and a **private root**
  (:mod:`sandbox_confine`): only the interpreter, the system libraries, the time-zone data and
  four device nodes, read-only, plus a tmpfs of ``disk_mb`` MiB as the sandbox directory (the
  total-disk-use limit: ENOSPC past it). The repo, /etc, ~/.ssh do not exist there. As real
  root it then drops to ``nobody``.
* **landlock** (when the kernel has it; both processes): files only beneath the allowed paths,
  no TCP, no signals to and no abstract sockets of processes outside its domain, no ptrace of
  them.
* **seccomp** (x86-64; both processes): no fork/vfork/exec or clone of a process (threads are
  fine), no sockets, no ptrace or cross-process memory access, no mount/namespace/keyring/bpf/
  kernel-administration calls.
* **rlimits**: CPU seconds, address space, largest file, 64 open files, processes, no core.
* **Audit hook**: a Python-level layer with clear error messages (files outside the sandbox
  directory and the read-only paths, sockets, new processes, signals to others, ctypes,
  sub-interpreters, tracing, gc walks). It captures the C functions it calls, so patching
  ``os.path`` or builtins does not change its answers, but against native code it is no
  boundary. Frame introspection is allowed: ``typing``, ``dataclasses``, ``enum``,
  ``namedtuple``, ``logging``, ``traceback``, ``fractions``, ``decimal``, ``statistics`` use it,
  and there is nothing to find.
* **Supervisor** (:mod:`.supervisor`): wall-clock limit, stdout/stderr capped at
  ``output_bytes`` (killed at the cap), without a private root the sandbox directory's size
  polled every 0.1 s against ``disk_mb`` (killed past it; it can overshoot by what the program
  writes in 0.1 s, each file at most ``file_mb``), both process groups SIGKILLed after every
  run, and an optional ``threading.Event`` to cancel a run (status 'cancelled').

**Isolation modes** (``reward.sandbox_isolation``). 'auto': namespaces when a probe run with
them passes here, else without (logged once); 'namespaces': require them (the constructor
raises where they do not work); 'audit': never use them. Without namespaces the solution process
shares the host's file system, network and PID namespace: landlock then keeps it to the sandbox
directory and the read-only paths and away from the judge and the parent, seccomp keeps it from
forking, sockets and ptrace, and the disk limit is the polling one. On a kernel with neither
landlock nor seccomp the audit hook alone guards files, network, processes and the judge: it
stops ordinary Python, not a native exploit. Which layers every run gets is decided by a probe
run at construction (:attr:`Sandbox.layers`); a run whose process cannot apply one of them ends
with 'error' instead of running with less.

**What the tests can do.** Test code runs in the judge, so it uses the solution the way Python
code uses an object: call it, read and set attributes, index, iterate, ``len``, truth, ``str``,
``isinstance``, catch its exceptions (the judge re-raises them as the built-in class of the
same name, or as a class made for the solution's own exception class), pass callbacks (they
stay in the judge; the solution calls back). Plain containers passed as arguments travel by
value and the changes the call made are copied back (``rotate(nums)``). Between two of the
solution's objects, ``==``, ordering and arithmetic are the solution's; arithmetic results must
be its objects again. pytest-style tests get ``raises``, ``approx``, ``mark.parametrize``,
``fixture``, ``capsys`` (:mod:`sandbox_pytest`); ``tmp_path``, ``monkeypatch`` and async tests
are not supported, and module attributes that hold containers are read as copies.

**What remains possible.** (1) Weak tests: a solution that satisfies the tests without solving
the problem (answers hard-coded for the visible inputs, a truthy object for ``assert f(x)``)
passes, as it would anywhere. (2) Whatever the tests take from the solution is the solution's:
helpers of the prompt the tests call, its objects' attributes and methods, and expected values
the tests build with its classes (``assert f() == Point(1, 2)`` with the solution's ``Point``
compares as the solution says; a handle never equals plain data). It cannot shadow builtins or
stdlib modules for the tests. (3) A handle answers each forwarded question (``len``, ``in``,
truth) on its own, so it may answer inconsistently where no plain value could; and it may
hand back any object the tests gave it. (4) Kernel exploits from inside the namespaces /
landlock / seccomp (it is not a VM). (5) With the audit hook as the only layer, Python-level
holes in the hook (one known: ``_imp.create_builtin`` rebuilds ``posix`` with
``pidfd_open``, and a pidfd signal is not an audited event, so the parent could be killed;
landlock, seccomp or the PID namespace each stop that). (6) Resource use up to the limits, and time: a slow or sleeping solution
costs wall time and scores the timeout reward.

**Layout.** The parent's side: :mod:`.sandbox` (:class:`~.sandbox.Sandbox`: probes this host's
layers, chooses the plan, runs jobs), :mod:`.supervisor` (one run: starts and watches both
processes, reads the verdict), :mod:`.job` (job kinds, limits, result, layer names; what those
two share). ``confined/`` holds the code of the two confined interpreters and nothing else: it
is the only directory their bootstrap puts on ``sys.path`` (next to the standard library), so
neither process can import ``megatron_rl`` or any third-party package, even by accident; its
modules import only the standard library and each other, by top-level name. Beside them,
:mod:`.isolated_call` is the killable (unconfined) grading process the math reward uses.
"""
