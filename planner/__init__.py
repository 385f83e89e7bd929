"""The SLO planner: a pure decision loop that sizes prefill and decode replicas to TTFT and ITL targets
(``policy``), per-role service-time models fitted from engine measurements (``service_model``), and a
discrete-event simulator of a serving group that tests the planner without a GPU (``simulator``, ``traces``).
See docs/planner.md."""
