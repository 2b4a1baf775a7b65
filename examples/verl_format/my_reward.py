"""A reward function written for verl, used here unchanged: verl calls it by keyword with the
row's data_source and extra_info, the decoded response and reward_model.ground_truth."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str.strip() == ground_truth
    return {"score": 1.0 if correct else 0.0, "acc": correct}
