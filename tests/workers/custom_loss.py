"""A user's policy loss for the tests: `algo.policy_loss=workers.custom_loss:halved_dapo`."""

from dataclasses import replace

from megatron_dapo.algo.policy_losses import LossInputs, TokenTerms, dapo, register_policy_loss


@register_policy_loss("halved_dapo", eps_low=0.1, eps_high=0.1)
def halved_dapo(x: LossInputs) -> TokenTerms:
    """Half of DAPO's token terms (with this loss's own default clip range)."""
    terms = dapo(x)
    return replace(terms, loss=terms.loss / 2)


def undecorated(x: LossInputs) -> TokenTerms:
    return dapo(x)
