"""The code of the sandbox's two confined interpreters (the solution process: ``sandbox_child``,
``sandbox_server``; the judge process: ``sandbox_judge``, ``sandbox_remote``, ``sandbox_pytest``;
both: ``sandbox_wire``, ``sandbox_confine``).

This directory is the only one their bootstrap (``supervisor._boot``) puts on ``sys.path``, next
to the standard library (``python -I -S``), and each process drops it again once its modules are
loaded. So its modules import only the standard library and each other, by top-level name (the
``sandbox_`` prefix keeps those names clear of anything a solution or a test module imports);
``tests/unit/test_sandbox_confined.py`` checks that. The parent imports two of them as
``megatron_rl.reward.sandbox.confined.*``: ``sandbox_confine`` (to probe landlock) and, in tests,
``sandbox_wire``. This ``__init__`` is never imported by the confined interpreters.
"""
