"""A validation report to test its readers on: three runs, an offline prediction and training curves
(``sample_report``), built as validate_draft builds it."""
from eaglenest.settings import ValidateSettings
from eaglenest.validation.report import build_report, train_summary

WARN_BELOW = ValidateSettings.defaults().warn_below  # validate.warn_below as the schema gives it

# n-gram's acceptance length (per drafted step) is above EAGLE-3's, its tokens per target step far below: the
# report must compare the latter (a finding would fire on the former).
RUNS = {
    "baseline": {"output_tokens_per_s": 100.0, "mean_latency_s": 1.0, "completion_tokens": 4000, "wall_s": 40.0,
                 "one_request": {"output_tokens_per_s": 50.0, "ms_per_token": 20.0, "passes": 1},
                 "tokens_per_step": 1.0, "drafted_share": 0.0,
                 "answers": [{"completion_token_ids": [1, 2], "prompt_token_ids": [0]}]},
    "eagle3": {"output_tokens_per_s": 180.0, "acceptance_length": 2.5, "acceptance_rate": 0.5,
               "tokens_per_step": 2.45, "drafted_share": 1.0,
               "one_request": {"output_tokens_per_s": 110.0, "ms_per_token": 9.1, "passes": 1},
               "per_position": [0.8, 0.45, 0.25], "answers": []},
    "ngram": {"output_tokens_per_s": 110.0, "acceptance_length": 2.6, "acceptance_rate": 0.53,
              "tokens_per_step": 1.3, "drafted_share": 0.2,
              "one_request": {"output_tokens_per_s": 60.0, "ms_per_token": 16.7, "passes": 1},
              "per_position": [0.8, 0.5, 0.3], "answers": []},
}
OFFLINE = {"acceptance_length": 2.6, "acceptance_rate": 0.53, "per_position": [0.82, 0.48, 0.3], "tokens_per_step": 2.55,
           "drafted_share": 1.0}
CURVES = {"step": [1.0, 2.0, 3.0], "loss": [3.0, 2.0, 1.5], "loss_0": [1.0, 0.7, 0.5], "loss_1": [1.2, 0.9, 0.6],
          "acc_0": [0.3, 0.6, 0.8], "acc_1": [0.2, 0.4, 0.6], "ttt_length": 2}


def sample_report(**over):
    """build_report of RUNS, OFFLINE and CURVES, with ``over`` its keyword arguments changed."""
    kw = dict(target="toy/target", draft_dir="draft/checkpoint", k=3, prompts=40, max_tokens=256, runs=RUNS,
              offline=OFFLINE, train=train_summary(CURVES, 3), checks={"served_dtype": "bfloat16"},
              settings={"concurrency": 8}, warn_below=WARN_BELOW)
    kw.update(over)
    return build_report(**kw)
