"""Module of the train_metrics.yaml error fixture: a metric function."""


def score(output, target):
    return (output.argmax(1) == target).float().mean()
