"""Every named result the evidence pages show: its JSON, its command, its kind.

Each entry names a table a page includes (``evidence/tables/<name>.md``);
``docs/tables.py`` says what each kind of result renders.
"""

from __future__ import annotations

from tables import (
  Accuracy,
  CodingTimes,
  ExchangeTimes,
  Finals,
  FirstCalls,
  Interleaved,
  Losses,
  ModelTimes,
  Named,
  Pivot,
  Result,
  Rows,
  Selections,
  Startups,
  StepTimes,
  StepUpdates,
)

FROM_LOCAL_AND_LINK = ("python benchmarks/network_training.py --from-json LOCAL.json "
                       "--link-seconds LINK.json")
"""The tables of losses trained on emulated devices, each step timed at its run's link step."""

FAST_LINK = ("python benchmarks/network.py --rate 100gbit --sizes 1000000 8000000 25000000 "
             "--densities 0.01 --ranks --algorithms topka2a topka2a_sparse allgather "
             "quantized_8_8_fine quantized_4_8 rotated_4_8 --json out.json")
"""The run of every form that codes, and the top-k forms, where the wire costs little."""

RESULTS: dict[str, Named] = {
    "local_steps_on_a_slow_link": Result(
        command=("python benchmarks/network_training.py --rate 100mbit --batch B --seed S "
                 "--runs dense quantized_8_8_fine \"local 4, rotated_4_8\" "
                 "\"local 4, rotated_4_4\""),
        groups=(("local_steps_rotated_4_4_100mbit_batch2_seed0_2026-12-06.json",),
                ("local_steps_rotated_4_4_100mbit_batch2_seed1_2026-12-06.json",),
                ("local_steps_rotated_4_4_100mbit_batch8_seed0_2026-12-06.json",),
                ("local_steps_rotated_4_4_100mbit_batch8_seed1_2026-12-06.json",)),
        against="quantized_8_8_fine"),
    "local_steps_round_lengths": Result(
        command=("python benchmarks/network_training.py --local --batch 8 --seed 0 --runs dense "
                 "\"local 2\" \"local 4\" \"local 4, exact mean\" \"local 8\""),
        groups=(("local_steps_local_batch8_seed0_2026-12-05.json",
                 "local_steps_local_batch8_seed0_more_2026-12-05.json"),)),
    "overlapped_rounds_loss": Result(
        command=("python benchmarks/network_training.py --local --batch B --seed S --runs "
                 "\"local 4, rotated_4_4\" \"local 4, rotated_4_4, overlapped eager\" "
                 "\"local 4, rotated_4_4, overlapped delayed\"` and `... --runs "
                 "\"local 4, rotated_4_4, overlapped own\""),
        groups=tuple((f"overlap_local_batch{batch}_seed{seed}_2026-12-07.json",
                      f"overlap_own_local_batch{batch}_seed{seed}_2026-12-07.json",
                      f"local_steps_rotated_4_4_100mbit_batch{batch}_seed{seed}_2026-12-06.json")
                     for batch in (8, 2) for seed in (0, 1)),
        runs=("dense", "local 4, rotated_4_4", "local 4, rotated_4_4, overlapped own",
              "local 4, rotated_4_4, overlapped eager", "local 4, rotated_4_4, overlapped delayed"),
        against="local 4, rotated_4_4", also_against="dense"),
    "overlapped_shorter_rounds": Result(
        command=("python benchmarks/network_training.py --local --batch 8 --seed 0 --runs "
                 "\"local 2, rotated_4_4, overlapped own\" \"local 2, rotated_4_4\""),
        groups=(("overlap_local_batch8_seed0_2026-12-07.json",
                 "overlap_shorter_local_batch8_seed0_2026-12-07.json"),),
        runs=("local 4, rotated_4_4", "local 2, rotated_4_4",
              "local 2, rotated_4_4, overlapped own"),
        against="local 4, rotated_4_4"),
    "overlapped_steps_on_a_slow_link": StepTimes(
        command=("python benchmarks/network_training.py --rate 100mbit --steps 24 "
                 "--eval-every 24 --batch 8 --runs quantized_8_8_fine \"local 4, rotated_4_4\" "
                 "\"local 4, rotated_4_4, overlapped own\" "
                 "\"local 4, rotated_4_4, overlapped eager\" "
                 "\"local 2, rotated_4_4, overlapped own\" \"no exchange (compute alone)\""),
        file="overlap_link_steps_100mbit_batch8_2026-12-07.json",
        against="quantized_8_8_fine", alone="no exchange (compute alone)"),
    "training_rotated": Result(
        command=FROM_LOCAL_AND_LINK,
        groups=tuple((f"network_training_rotated_batch{batch}_seed{seed}_2026-12-04.json",)
                     for batch in (2, 8) for seed in (0, 1))),
    "training_rotated_seeds": Finals(
        command="python benchmarks/network_training.py --local --batch 2 --seed S --runs ...",
        groups=(*((f"network_training_fine_batch2_seed{seed}_2026-12-03.json",
                   f"rotated_local_batch2_seed{seed}_2026-12-04.json") for seed in (0, 1)),
                *((f"fewbit_local_batch2_seed{seed}_2026-12-03.json",
                   f"fewbit_fine_local_batch2_seed{seed}_2026-12-03.json",
                   f"rotated_local_batch2_seed{seed}_2026-12-04.json") for seed in (2, 3, 4, 5))),
        runs=("dense", "quantized_8_8_fine", "rotated_4_8"), steps_of="rotated_4_8"),
    "training_fine": Result(
        command=FROM_LOCAL_AND_LINK,
        groups=tuple((f"network_training_fine_batch{batch}_seed{seed}_2026-12-03.json",)
                     for batch in (8, 2) for seed in (0, 1))),
    "training_fine_seeds": Finals(
        command="python benchmarks/network_training.py --local --batch 2 --seed S --runs ...",
        groups=(*((f"network_training_fine_batch2_seed{seed}_2026-12-03.json",)
                  for seed in (0, 1)),
                *((f"fewbit_local_batch2_seed{seed}_2026-12-03.json",
                   f"fewbit_fine_local_batch2_seed{seed}_2026-12-03.json")
                  for seed in (2, 3, 4, 5))),
        runs=("dense", "quantized_8_8", "quantized_8_8_fine")),
    "training_fewbit": Result(
        command=FROM_LOCAL_AND_LINK,
        groups=tuple((f"network_training_fewbit_batch{batch}_seed{seed}_2026-12-03.json",)
                     for batch in (2, 8) for seed in (0, 1))),
    "training_fewbit_seeds": Finals(
        command=("python benchmarks/network_training.py --local --batch 2 --seed S --runs dense "
                 "quantized_8_8"),
        groups=(*((f"network_training_fewbit_batch2_seed{seed}_2026-12-03.json",)
                  for seed in (0, 1)),
                *((f"fewbit_local_batch2_seed{seed}_2026-12-03.json",) for seed in (2, 3, 4, 5))),
        runs=("dense", "quantized_8_8"), steps_of="quantized_8_8"),
    "training_on_the_link": Result(
        command=("python benchmarks/network_training.py --batch B --seed 0 --runs quantized_8_8` "
                 "(the link), beside dense from `" + FROM_LOCAL_AND_LINK),
        groups=tuple((f"link_quantized_8_8_batch{batch}_seed0_2026-12-03.json",
                      f"network_training_fewbit_batch{batch}_seed0_2026-12-03.json")
                     for batch in (8, 2)),
        runs=("dense", "quantized_8_8")),
    "local_steps_round_candidates": Result(
        command=("python benchmarks/network_training.py --local --batch 8 --seed 0 --runs dense "
                 "\"local 4\"` and `... --runs \"local 4, exact mean\" \"local 2\" \"local 8\"` "
                 "and `... --runs \"local 4, rotated_4_8\" \"local 4, top-k 3%\""),
        groups=(("local_steps_local_batch8_seed0_2026-12-05.json",
                 "local_steps_local_batch8_seed0_more_2026-12-05.json",
                 "local_steps_candidates_local_batch8_seed0_2026-12-05.json"),),
        runs=("dense", "local 2", "local 4", "local 4, exact mean", "local 4, rotated_4_8",
              "local 4, top-k 3%", "local 8")),
    "local_steps_first_link_run": Result(
        command=("python benchmarks/network_training.py --from-json LOCAL.json --link-seconds "
                 "local_steps_link_steps_100mbit_batch8_2026-12-05.json"),
        groups=(("local_steps_100mbit_batch8_seed0_2026-12-05.json",),),
        runs=("dense", "quantized_8_8_fine", "local 2", "local 4", "local 8")),
    "forms_by_optimizer": Pivot(
        command="python benchmarks/forms_by_optimizer.py --json out.json",
        file="forms_by_optimizer_2026-12-04.json", down="optimizer", across="form",
        columns=("top-k 1%", "8 bits", "4 / 8 bits", "headline"),
        headings=("top-k 1%", "8 bits", "4 / 8 bits", "`topka2a(0.01)`"),
        cell="{ratio:,.2f}x ({bytes:,.0f} B)"),
    "forms_defaults_before_adam": Result(
        command="python benchmarks/network_training.py --local --batch B --seed S --runs dense "
                "defaults",
        groups=(("defaults_local_b4_seed11_2026-12-04.json",),
                ("defaults_local_b2_seed0_2026-12-04.json",),
                ("defaults_local_b8_seed0_2026-12-04.json",))),
    "updates_at_a_larger_batch": Result(
        command="python benchmarks/network_training.py --seed S --batch 8 --runs dense updates "
                "defaults",
        groups=(("network_training_batch8_2026-12-01.json",),
                ("network_training_batch8_seed1_2026-12-01.json",)),
        highest=True),
    "onebit_at_a_larger_batch": Result(
        command="python benchmarks/network_training.py --batch 8 --seed 0 --runs dense updates "
                "\"updates, onebit\" \"updates, onebit_4\" onebit \"momentum, variance "
                "frozen at 30, onebit\"",
        groups=(("network_training_onebit_batch8_2026-12-02.json",),), highest=True),
    "onebit_both_batches": Result(
        command="python benchmarks/network_training.py --batch B --seed S --runs dense updates "
                "\"updates, onebit\" \"updates, onebit_4\" \"momentum, variance frozen at "
                "30, onebit\" onebit",
        groups=(("network_training_onebit_batch2_2026-12-02.json",),
                ("network_training_onebit_batch2_seed1_2026-12-02.json",),
                ("network_training_onebit_batch8_seed1_2026-12-02.json",)),
        highest=True),
    "onebit_back": Result(
        command="python benchmarks/network_training.py --batch 8 --seed 0 --runs dense "
                "\"updates, onebit_1\"",
        groups=(("network_training_onebit_1_batch8_2026-12-02.json",),), highest=True),
    "charlm_few_bit": Losses(
        command=("python examples/train_charlm.py --seeds 0 1 --runs \"dense (pmean)\" "
                 "quantized_8_8 quantized_4_8 \"updates, onebit_4\"`, then `--runs "
                 "quantized_8_8_fine` and `--runs rotated_4_8 rotated_4_4"),
        files=("charlm_fewbit_2026-12-03.json", "charlm_fewbit_fine_2026-12-03.json",
               "charlm_rotated_2026-12-04.json"),
        against="dense (pmean)"),
    "charlm_3000_steps": Losses(
        command=("python examples/train_charlm.py --steps 3000 --runs \"dense (pmean)\" "
                 "quantized_8_8 \"updates, onebit_4\"`, then `--steps 3000 --runs rotated_4_8 "
                 "rotated_4_4"),
        files=("charlm_fewbit_3000_2026-12-03.json", "charlm_rotated_3000_2026-12-04.json"),
        against="dense (pmean)", at=(250, 500, 1000, 1500, 2000, 2500)),
    "digits_defaults": Accuracy(
        command="python examples/train_digits.py",
        file="digits_defaults_2026-12-07.json", against="dense (pmean)"),
    "digits_all": Accuracy(
        command="python examples/train_digits.py --all",
        file="digits_all_2026-12-07.json", against="dense (pmean)"),
    "digits_signs": Accuracy(
        command=("cd examples && python train_digits.py --runs \"dense (pmean)\" \"updates 1%\" "
                 "\"updates, onebit\" \"onebit (gradient)\""),
        file="digits_onebit_2026-12-02.json", against="dense (pmean)"),
    "charlm_600": Losses(
        command=("python examples/train_charlm.py --runs \"dense (pmean)\" \"topka2a 1%\" "
                 "\"topka2a 5%\" \"topka2a 1%, no error feedback\" \"allgather (TopkA) 1%\" "
                 "\"topka2a 1%, 100 dense warm-up steps\""),
        files=("charlm_600_2026-12-07.json",), against="dense (pmean)"),
    "charlm_signs": Losses(
        command=("python examples/train_charlm.py --runs \"dense (pmean)\" \"updates 1%\" "
                 "\"updates, onebit\" \"updates, onebit_4\""),
        files=("charlm_onebit_2026-12-02.json",), against="dense (pmean)"),
    "first_call_now": FirstCalls(
        command="python benchmarks/first_call.py --trials 5 --runs pmean topka2a "
                "compress_updates",
        file="first_call_2105f31_2026-12-03.json"),
    "first_call_at_969e1d2": FirstCalls(
        command="python benchmarks/first_call.py --trials 5 --runs pmean topka2a "
                "compress_updates",
        file="first_call_969e1d2_2026-12-02.json"),
    "first_call_at_54a7b72": FirstCalls(
        command="python benchmarks/first_call.py --trials 5 --runs pmean topka2a "
                "compress_updates \"topka2a, buckets split to overlap the backward pass\"",
        file="first_call_54a7b72_2026-12-02.json"),
    "first_call_split": Rows(
        command="python benchmarks/first_call.py --split --runs pmean topka2a compress_updates "
                "\"topka2a, one bucket, exact selection\"",
        file="first_call_split_6cf0a24_2026-12-03.json",
        columns=(("run", "run", ""), ("estimate s", "estimate_s", ".2f"),
                 ("lower s", "lower_s", ".2f"), ("compile s", "compile_s", ".2f"),
                 ("kernels", "kernels", ""), ("sparse collectives", "gathers_and_alltoalls", ""))),
    "first_call_cache": FirstCalls(
        command="python benchmarks/first_call.py --trials 3 --runs pmean topka2a "
                "\"topka2a, compilation cache warm\"",
        file="first_call_cache_54a7b72_2026-12-02.json"),
    "first_call_small": FirstCalls(
        command="python benchmarks/first_call.py --model small --runs pmean topka2a --trials 5",
        file="first_call_small_2026-12-03.json"),
    "first_call_small_exact": FirstCalls(
        command="python benchmarks/first_call.py --model small --runs pmean topka2a "
                "\"topka2a, one bucket, exact selection\" --trials 5",
        file="first_call_small_exact_2026-12-03.json"),
    "startup": Startups(
        command="python benchmarks/startup.py --trials 7 --checkout /tmp/b6546c8",
        file="startup_5b066d9_vs_b6546c8_2026-12-03.json", revisions=("5b066d9", "b6546c8")),
    "nodes_flat_and_two_level": Rows(
        command="python benchmarks/network_nodes.py --json out.json",
        file="network_nodes_2026-12-07.json",
        columns=(("algorithm", "algorithm", ""), ("density", "density", "g"),
                 ("route", "route_label", ""), ("seconds", "seconds", ".2f"),
                 ("model seconds", "model_seconds", ".2f"), ("card bytes", "card_bytes", ",.0f"),
                 ("model card bytes", "model_card_bytes", ",.0f"),
                 ("seconds vs one axis", "seconds_vs_one_axis", ".2f"),
                 ("bytes vs one axis", "bytes_vs_one_axis", ".3f")),
        where=(("algorithm", ("dense", "allgather", "topka2a", "topka2a_sparse", "gtopk",
                              "oktopk")),)),
    "selection_in_a_step": Rows(
        command="python benchmarks/step_time.py --json out.json",
        file="step_time_2026-12-07.json",
        columns=(("algorithm", "algorithm", ""), ("buckets", "buckets", ""),
                 ("exact s", "exact_s", ".3f"), ("threshold s", "threshold_s", ".3f"),
                 ("exact / threshold", "speedup", ".2f"))),
    "selection_kernels": Selections(
        command="python benchmarks/selection.py --json out.json",
        file="selection_2026-12-07.json"),
    **{name: Rows(command=command, file=file,
                  columns=(("run", "run", ""), ("held-out MSE", "mse", ".4f"),
                           ("x dense", "ratio", ".2f")))
       for name, command, file in (
           ("quickstart", "python examples/quickstart.py --json out.json",
            "quickstart_2026-12-07.json"),
           ("quickstart_high_learning_rate",
            "python examples/quickstart.py --lr 1e-2 --json out.json",
            "quickstart_lr1e-2_2026-12-07.json"))},
    "link_every_exchange": ExchangeTimes(
        command="python benchmarks/network.py --json out.json",
        file="network_2026-12-04.json"),
    "link_coding": CodingTimes(
        command="python benchmarks/network.py --json out.json",
        file="network_2026-12-04.json"),
    "link_fast": ExchangeTimes(command=FAST_LINK, file="network_2026-12-04_100gbit.json"),
    "link_fast_coding": CodingTimes(command=FAST_LINK, file="network_2026-12-04_100gbit.json"),
    "link_step_updates": StepUpdates(
        command="python benchmarks/network_step.py --gradients flat gpt2 --json OUT",
        files=(("before (1fcd0da)", "network_step_1fcd0da_2026-12-01.json"),
               ("after (d9d8e06)", "network_step_d9d8e06_2026-12-01.json"),
               ("again (a91be7e)", "network_step_a91be7e_2026-12-01.json"))),
    "link_regression_found": Interleaved(
        command="python benchmarks/ab_step.py --a 06f68f3 --b a9057c7 --rounds 3",
        file="ab_step_gpt2_06f68f3_vs_a9057c7_2026-12-03.json"),
    "link_regression_undone": Interleaved(
        command="python benchmarks/ab_step.py --a 06f68f3 --b a5735d0 --rounds 3",
        file="ab_step_gpt2_06f68f3_vs_a5735d0_2026-12-03.json"),
    "local_steps_memory": Rows(
        command="python benchmarks/local_steps_memory.py --json out.json",
        file="local_steps_memory_2026-12-06.json",
        columns=(("step", "run", ""), ("arguments MB", "arguments_mb", ".0f"),
                 ("temporaries MB", "temporaries_mb", ".0f"))),
    "nonfinite_check_forms": Rows(
        command="python benchmarks/nonfinite_check.py --json out.json",
        file="nonfinite_check_2026-12-07.json",
        columns=(("form", "form", ""), ("seconds", "seconds", ".4f"),
                 ("x one read", "vs_read", ".1f"), ("sees one NaN", "sees_nan", ""))),
    "nonfinite_check_on_the_link": Interleaved(
        command=("python benchmarks/ab_step.py --a 711436b --b DIR --rounds 4, DIR holding "
                 "the library with the check as two reductions"),
        file="ab_step_gpt2_711436b_vs_nonfinite_sum_2026-12-07.json"),
    "sparse_allreduces_on_the_link": ExchangeTimes(
        command=("python benchmarks/network.py --rate 1gbit --processes 4 --sizes 25000000 "
                 "--densities 0.001 0.01 0.1 --ranks --algorithms dense allgather topka2a "
                 "topka2a_sparse gtopk oktopk"),
        file="global_top_k_1gbit_2026-12-07.json"),
    "sparse_allreduces_on_the_link_earlier": ExchangeTimes(
        command=("the same, before Ok-Topk sent each owner its entries in index order "
                 "(8d5c911)"),
        file="global_top_k_1gbit_earlier_2026-12-07.json"),
    "sparse_allreduces_link_task_plain_sgd": Finals(
        command=("python benchmarks/network_training.py --local --seed S --runs \"plain SGD, "
                 "dense\" \"plain SGD, topka2a\" \"plain SGD, topka2a_sparse\" \"plain SGD, "
                 "gtopk\" \"plain SGD, oktopk\""),
        groups=tuple((f"plain_sgd_global_top_k_local_batch2_seed{seed}_2026-12-07.json",)
                     for seed in (0, 1, 2)),
        runs=("plain SGD, dense", "plain SGD, topka2a", "plain SGD, topka2a_sparse",
              "plain SGD, gtopk", "plain SGD, oktopk"),
        against="plain SGD, dense"),
    "sparse_allreduces_digits_plain_sgd": Accuracy(
        command=("cd examples && python train_digits.py --momentum 0 --learning-rate 0.5 "
                 "--runs \"topka2a 1%\" \"dense (pmean)\" \"allgather (TopkA) 1%\" "
                 "\"topka2a_sparse 1%, threshold selection\" \"gtopk 1%\" \"oktopk 1%\""),
        file="digits_plain_sgd_global_top_k_2026-12-07.json", against="topka2a 1%"),
    **{f"sparse_allreduces_model_{network}": ModelTimes(
        algorithms=("dense", "allgather", "topka2a", "topka2a_sparse", "gtopk", "oktopk"),
        devices=(8, 16, 32), length=25_000_000, density=0.01, network=network)
       for network in ("eth10", "ib100")},
}
"""Every table of the evidence pages, by the name its page includes it under."""
