"""dataset.generate: the target writes its own training questions on the trace server (eaglenest.data.questions)."""
from eaglenest.logs import to_log

to_log(snakemake.log[0])

from transformers import AutoTokenizer

from eaglenest.data.questions import write_questions
from eaglenest.serving.probe import check_sentinel
from eaglenest.serving.settings import ServerConfig
from eaglenest.settings import QuestionSettings
from eaglenest.validation.evalsets import load_set, resolve_sets

settings, server = QuestionSettings.from_config(snakemake.config), ServerConfig.from_config(snakemake.config)
api_key = server.api_key()
ready = check_sentinel(snakemake.input.ready, api_key)
# The evaluation sets' questions are never training questions (the held-out split is made from these).
exclude = [text for s in resolve_sets(settings.evalsets, None)[1:] for row in load_set(s, cache_dir=settings.cache_dir)
           for text in [*(m["content"] for m in row["messages"] if m["role"] == "user"), row.get("second_turn")] if text]
write_questions(snakemake.output[0], settings, url=ready["urls"][0], model=ready["model"],
                tokenizer=AutoTokenizer.from_pretrained(server.model), exclude=exclude, api_key=api_key)
