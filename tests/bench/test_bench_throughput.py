"""The throughput comparison (``scripts/throughput.py``) runs its engines in worker
processes, counts tokens right, sends chat prompts through the model's template,
and compares outputs."""

import json

import pytest

import throughput
import throughput_records as records
from helpers import CHATML, write_tiny_gguf
from hf_worker import static_batch_accounting, static_batches
from minipaged.bench import harness


def test_static_batches_decode_to_their_longest_request():
    acc = static_batch_accounting([3, 5, 2, 7, 1], batch_size=2)
    # batches [3, 5], [2, 7], [1]: 5 + 7 + 1 steps
    assert acc["decode_steps"] == 13
    assert acc["generated_tokens"] == 2 * 5 + 2 * 7 + 1
    assert acc["requested_tokens"] == 18
    assert acc["discarded_share"] == pytest.approx(1 - 18 / 25)
    assert [list(b) for b in static_batches(5, 2)] == [[0, 1], [2, 3], [4]]


def test_only_requested_tokens_count():
    # A static batch's rows all run to the longest: the extra tokens do not count.
    d = records.delivered([3, 5], [5, 5])
    assert (d["requested_tokens"], d["produced_tokens"], d["generated_tokens"]) == (8, 8, 10)
    assert not d["exact"] and d["short_requests"] == 0 and d["mismatches"] == [[0, 3, 5]]
    # A request cut short is visible and its missing tokens are not counted.
    d = records.delivered([3, 5], [3, 4])
    assert d["produced_tokens"] == 7 and d["short_requests"] == 1
    assert records.delivered([3, 5], [3, 5])["exact"]


def test_engine_args_parse_as_literals():
    assert throughput.parse_engine_args(["max_num_seqs=64", "swap_space=0.5", "x=true",
                                         "mode=swap", "n=None"]) == {
        "max_num_seqs": 64, "swap_space": 0.5, "x": True, "mode": "swap", "n": None}
    with pytest.raises(ValueError):
        throughput.parse_engine_args(["novalue"])


def test_outputs_compare_request_by_request():
    assert records.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert records.first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert records.first_difference([1, 2], [1, 2, 3]) == 2  # a prefix differs where it ends
    c = records.compare_outputs([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 7], [8]])
    assert c == {"identical": 1, "requests": 3, "differences": [[1, 1], [2, 0]]}
    with pytest.raises(ValueError, match="requests"):
        records.compare_outputs([[1]], [[1], [2]])


def test_output_len_and_file_tag():
    assert throughput.parse_output_len("96") == (96, 96)
    assert throughput.parse_output_len("64..128") == (64, 128)
    for bad in ("0", "9..3", "a..b", "64-128"):
        with pytest.raises(ValueError, match="--output-len"):
            throughput.parse_output_len(bad)
    lens = throughput.output_lengths(200, (64, 128), seed=0)
    assert min(lens) >= 64 and max(lens) <= 128 and len(set(lens)) > 10
    assert lens == throughput.output_lengths(200, (64, 128), seed=0)
    assert throughput.file_tag("SmolLM2-135M-Instruct") == "smollm2"
    assert throughput.file_tag("Qwen2-0.5B-Instruct") == "qwen2"
    assert throughput.file_tag("Llama-3.2-1B-Instruct.Q8_0") == "llama-3-2"
    assert throughput.file_tag("tiny-stdlib-llama") == "tiny-stdlib-llama"


def test_records_keep_token_lists_on_one_line(tmp_path):
    data = {"ids": [[1, 2, 3], [4]], "nested": {"x": [0.5, None, "a,b]"]}, "empty": {}}
    harness.write_json(tmp_path / "r.json", data)
    text = (tmp_path / "r.json").read_text()
    assert json.loads(text) == data
    assert "[1, 2, 3]" in text and '[0.5, null, "a,b]"]' in text


def _tiny_tokenizer(chat_template=None):
    from transformers import AutoTokenizer

    from minipaged.assets import default_model_dir
    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    tok.chat_template = chat_template
    return tok


def test_chat_prompts_go_through_the_template():
    from minipaged.bench.chat_prompts import CHAT_PROMPTS

    tok = _tiny_tokenizer(CHATML)
    prompts, how = throughput.chat_prompt_ids(tok, 3)
    assert "chat template" in how and len(prompts) == 3
    for ids, text in zip(prompts, CHAT_PROMPTS):
        # the template's text, tokenized, ending where the assistant's answer starts
        assert tok.decode(ids) == f"<s>user\n{text}</s>\n<s>assistant\n"
    plain, how = throughput.chat_prompt_ids(_tiny_tokenizer(), 2)
    assert "no chat template" in how
    assert [tok.decode(ids, skip_special_tokens=True) for ids in plain] == list(CHAT_PROMPTS[:2])


def test_quick_run_of_two_engines(tmp_path):
    record = throughput.main(["--quick", "--device", "cpu", "--engines", "minipaged,hf-generate",
                              "--max-wait", "0", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "throughput_cpu.json").read_text())
    assert saved["summary"] == json.loads(json.dumps(record["summary"]))
    assert (tmp_path / "throughput_cpu.png").stat().st_size > 0
    requested = sum(saved["workload"]["output_lens"])
    assert set(saved["results"]) == {"minipaged", "hf-generate"}
    for r in saved["results"].values():
        assert r["ok"], r.get("error")
        assert r["tokens_per_s"] > 0 and r["seconds"] > 0
        assert r["requested_tokens"] == r["produced_tokens"] == requested
        assert r["short_requests"] == 0
        assert [len(t) for t in r["output_token_ids"]] == saved["workload"]["output_lens"]
    assert saved["results"]["minipaged"]["exact"]
    # hf-generate's rows run to their batch's longest output, beyond what was asked
    hf = saved["results"]["hf-generate"]
    assert hf["generated_tokens"] == hf["static_batching"]["generated_tokens"] >= requested
    summary = saved["summary"]
    assert set(summary["tokens_per_s"]) == {"minipaged", "hf-generate"}
    assert summary["minipaged_over"]["hf-generate"] > 0
    assert summary["best_transformers"]["engine"] == "hf-generate"
    assert "minipaged_over" in summary["best_transformers"]
    # same model, same prompts: greedy first tokens agree (but for rare near-ties)
    assert summary["first_token_agreement_with_minipaged"]["hf-generate"] >= 0.5
    env = saved["environment"]
    assert env["torch_threads"] >= 1
    assert set(env["cpu"]["isa"]) <= set(harness.ISA_FLAGS) and env["cpu"]["model"]
    assert saved["model"]["weights"].startswith("random")


# -- a GGUF checkpoint with a chat template ---------------------------------------------

def test_gguf_run_with_chat_prompts(tmp_path):
    from minipaged.bench.chat_prompts import chat_conversations
    from minipaged.models.gguf import gguf_tokenizer

    gguf = write_tiny_gguf(tmp_path / "tiny-chat.gguf")
    record = throughput.main(["--quick", "--device", "cpu", "--model", str(gguf),
                              "--engines", "minipaged,hf-generate", "--output-len", "5..9",
                              "--max-wait", "0", "--bandwidth", "--out", str(tmp_path / "out")])
    assert (tmp_path / "out" / "throughput_tiny-chat_cpu.json").is_file()
    assert (tmp_path / "out" / "throughput_tiny-chat_cpu.png").stat().st_size > 0
    model, work = record["model"], record["workload"]
    assert model["source_format"] == "GGUF" and model["chat_template"]
    assert model["source_tensor_types"] == {"F16": 1 + 7 * 2, "F32": 1 + 2 * 2}
    assert model["parameters"] == 4096 * 64 + 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128
                                                   + 2 * 64) + 64
    assert "GGUF file itself" in model["loading"]["minipaged"]
    # the prompts every engine got: the chat template's, with the generation prompt
    tok = gguf_tokenizer(gguf)
    expected = [len(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"])
                for c in chat_conversations(work["num_requests"])]
    assert work["prompt_lens"] == expected
    assert all(5 <= n <= 9 for n in work["output_lens"])
    results = record["results"]
    assert all(r["ok"] for r in results.values()), results
    ours, peer = results["minipaged"], results["hf-generate"]
    assert [len(t) for t in ours["output_token_ids"]] == work["output_lens"]
    # the agreement count is what the token lists say
    same = record["summary"]["identical_to_minipaged"]["hf-generate"]
    assert same["identical"] == sum(a == b for a, b in zip(ours["output_token_ids"],
                                                           peer["output_token_ids"]))
    for i, pos in same["differences"]:
        a, b = ours["output_token_ids"][i], peer["output_token_ids"][i]
        assert a[:pos] == b[:pos] and a[pos] != b[pos]
    # same weights, same prompts: greedy first tokens agree (but for rare near-ties)
    assert record["summary"]["first_token_agreement_with_minipaged"]["hf-generate"] >= 0.5
    assert any(line.startswith("hf-generate: ") and "identical to minipaged" in line
               for line in throughput.format_table(record))
    # --bandwidth: the one-user bound is the lower reading over the weights' bytes
    bandwidth = record["memory_bandwidth"]
    assert bandwidth["weight_bytes"] == model["parameters"] * 4          # float32
    low = min(bandwidth["read_GBps_before"], bandwidth["read_GBps_after"]) * 1e9
    assert low > 0
    bound = bandwidth["one_user_bound_tokens_per_s"]
    assert bound == pytest.approx(low / bandwidth["weight_bytes"])
    for engine in ("minipaged", "hf-generate"):
        assert bandwidth["share_of_bound"][engine] == pytest.approx(
            results[engine]["tokens_per_s"] / bound)
    assert any(line.startswith("memory read ") for line in throughput.format_table(record))
