from test_eagle3 import *  # noqa

def test_facts(trained):
    arch, target, drafter, seqs, history = trained
    print("\n", arch, "loss", round(history[0][0], 3), "->", round(history[-1][0], 3),
          "tau_est", round(history[0][1]["tau_est"], 3), "->", round(history[-1][1]["tau_est"], 3),
          "acc_1", round(history[-1][1]["acc_1"], 3), "acc_7", round(history[-1][1]["acc_7"], 3))
    for mode in ("chain", "tree"):
        dec = SpeculativeDecoder(target, Eagle3Proposer(drafter, mode=mode), num_draft=7, eos_token_id=())
        taus = [round(dec.generate(r[:PROMPT], NEW).stats.tau, 2) for r in seqs]
        print("  ", mode, "tau per prompt", taus)
