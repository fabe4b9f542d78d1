"""vLLM's /metrics text as the tests read it: what vLLM 0.32 serves with a speculative config, and the same
exposition after more speculative steps."""
import re

# What vLLM 0.32's /metrics serves with a speculative config (prometheus_client text format), two engines.
METRICS_BEFORE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="toy"} 0.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="toy"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="toy"} 5.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="toy"} 1.7629e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="toy"} 30.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="toy"} 15.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="toy"} 12.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="toy"} 3.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="toy",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="toy",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="toy",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="toy",position="0"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="toy",position="1"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="toy",position="2"} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="toy",position="0"} 1.7629e+09
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="toy"} 2.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="toy"} 2.0
python_info{implementation="CPython",major="3",minor="11",patchlevel="9",version="3.11.9"} 1.0
weird_metric{path="a \\"quoted\\", {braced} value\\\\",other="x"} NaN 1700000000000
"""


def metrics_after(before: str, scale: dict) -> str:
    """The same exposition with each spec counter's value raised: value + scale[name] * (1 + position)."""
    out = []
    for line in before.splitlines():
        m = re.match(r"^(vllm:spec_decode_\w+_total)(\{.*\}) (\S+)$", line)
        if m and m.group(1) in scale:
            pos = re.search(r'position="(\d)"', line)
            add = scale[m.group(1)] * (1 if pos is None else 3 - int(pos.group(1)))
            line = f"{m.group(1)}{m.group(2)} {float(m.group(3)) + add}"
        out.append(line)
    return "\n".join(out) + "\n"
