"""Write churn.csv, the small categorical dataset behind recipes/tabular_categorical.yaml.

Generated, not collected: no licence question, and the rule is known, so a model's
accuracy can be judged. Customers of a made-up telecom churn (yes/no) by a fixed
logistic rule of their contract, plan, payment method, tenure and support calls,
plus noise; `region` carries no signal, and the rare `voucher` payment may be
missing from a training split, which exercises the unknown-category index.

Standard library only, seeded, so the committed file can be checked byte for byte:
    python recipes/data/make_tabular.py            # rewrites recipes/data/churn.csv
    python recipes/data/make_tabular.py -o out.csv
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import random
from pathlib import Path

SEED = 20240601
ROWS = 2400
PLANS = {"basic": 25.0, "standard": 55.0, "premium": 90.0}
CONTRACTS = ("monthly", "one_year", "two_year")
REGIONS = ("north", "south", "east", "west", "central", "coast", "islands", "mountains")
PAYMENTS = (("card", 0.45), ("bank_transfer", 0.35), ("cheque", 0.19), ("voucher", 0.01))
COLUMNS = ("customer_id", "plan", "contract", "region", "payment", "tenure_months", "monthly_charge", "support_calls", "churn")


def _pick(rng: random.Random, weighted: tuple[tuple[str, float], ...]) -> str:
    r, acc = rng.random(), 0.0
    for value, w in weighted:
        acc += w
        if r < acc:
            return value
    return weighted[-1][0]


def rows(seed: int = SEED, n: int = ROWS) -> list[dict[str, object]]:
    """The rule: churn when a logistic score of the customer plus noise is positive."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        plan = _pick(rng, (("basic", 0.4), ("standard", 0.4), ("premium", 0.2)))
        contract = _pick(rng, (("monthly", 0.5), ("one_year", 0.3), ("two_year", 0.2)))
        region = REGIONS[int(rng.random() * len(REGIONS))]
        payment = _pick(rng, PAYMENTS)
        tenure = 1 + int(rng.random() * 72)
        charge = round(PLANS[plan] + rng.gauss(0.0, 6.0), 2)
        calls = min(int(-math.log(1.0 - rng.random()) * 1.6), 12)  # mostly 0-3, a few many
        score = (
            {"monthly": 1.6, "one_year": -0.4, "two_year": -2.0}[contract]
            + {"basic": 0.2, "standard": -0.3, "premium": 0.6}[plan]
            + {"card": -0.3, "bank_transfer": -0.5, "cheque": 0.9, "voucher": 1.5}[payment]
            - 0.045 * (tenure - 24)
            + 0.55 * (calls - 1)
            + 0.02 * (charge - PLANS[plan])  # paying over the plan's list price annoys
        )
        noise = math.log(1.0 / (1.0 - rng.random()) - 1.0 + 1e-12) * 0.5  # logistic, scale 0.5
        out.append(
            {
                "customer_id": f"C{i:05d}",
                "plan": plan,
                "contract": contract,
                "region": region,
                "payment": payment,
                "tenure_months": tenure,
                "monthly_charge": f"{charge:.2f}",
                "support_calls": calls,
                "churn": "yes" if score + noise > 0 else "no",
            }
        )
    return out


def render(seed: int = SEED, n: int = ROWS) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows(seed, n))
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path, default=Path(__file__).with_name("churn.csv"))
    args = ap.parse_args()
    args.output.write_text(render())
    print(f"wrote {ROWS} rows to {args.output}")


if __name__ == "__main__":
    main()
