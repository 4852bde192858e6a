"""Domain rules and models shared by every role, the simulator and the audit: pure code, no Kafka.

Layering (checked by import-linter in ``make lint``): ``core`` and ``config`` sit below ``schemas``;
``schemas`` <- ``infra`` <- {``producers``, ``streams``, ``consumers``} <- the app (``cli``,
``launcher``, ``roles``). A rule that two roles (or a role and the simulator or audit) both apply
lives here once.
"""
