"""DeepSpeedExamples' DCGAN loop as it stands (training/gan/gan_deepspeed_train.py): client
``torch.optim.Adam`` optimizers, two engines built with ``args`` and a ``--deepspeed_config`` whose
``optimizer`` block the client optimizers override, no ZeRO, and forwards through the plain modules
(``net_d(real)``, not ``engine_d(real)``). The discriminator's engine takes two ``backward()`` calls per
``step()``; the generator's loss runs through the discriminator's module, whose gradients from that pass
stay in ``.grad`` until the next ``net_d.zero_grad()``. DeepSpeed's default ``gradient_clipping`` (1.0)
applies, and clips both engines' steps here (their gradient norms are 15-20).

DCGAN's networks (64 x 64 images, batch norm, its initialisation) at a small width, synthetic images, fixed
seeds; every rank takes its rows of one global batch per step. Rank 0 writes ``[errD_real, errD_fake,
errG]`` per step, each averaged over the ranks, to $DS_SCRIPTS_OUT/gan_adam.json.

    torchrun --nproc_per_node 2 train_gan_adam.py --deepspeed_config gan_adam.json [--steps N]
"""

from __future__ import annotations

import argparse
import itertools

import deepspeed
import torch
from common import write_losses
from torch import nn

NZ = 16  # noise channels
WIDTH = 8  # DCGAN's ngf / ndf
GLOBAL_BATCH = 8


def weights_init(m: nn.Module) -> None:
    """DCGAN's initialisation: conv weights N(0, 0.02), batch norm weights N(1, 0.02), biases 0."""
    if isinstance(m, nn.Conv2d | nn.ConvTranspose2d):
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif isinstance(m, nn.BatchNorm2d):
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


def generator() -> nn.Module:
    """Noise (NZ x 1 x 1) -> a 3 x 64 x 64 image in [-1, 1]."""
    torch.manual_seed(1)
    layers: list[nn.Module] = []
    channels = [NZ, WIDTH * 8, WIDTH * 4, WIDTH * 2, WIDTH]
    for i, (cin, cout) in enumerate(itertools.pairwise(channels)):
        layers += [nn.ConvTranspose2d(cin, cout, 4, 1 if i == 0 else 2, 0 if i == 0 else 1, bias=False)]
        layers += [nn.BatchNorm2d(cout), nn.ReLU(True)]
    net = nn.Sequential(*layers, nn.ConvTranspose2d(WIDTH, 3, 4, 2, 1, bias=False), nn.Tanh())
    net.apply(weights_init)
    return net


def discriminator() -> nn.Module:
    """A 3 x 64 x 64 image -> the probability that it is real."""
    torch.manual_seed(2)
    layers: list[nn.Module] = [nn.Conv2d(3, WIDTH, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True)]
    for cin in (WIDTH, WIDTH * 2, WIDTH * 4):
        layers += [nn.Conv2d(cin, cin * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(cin * 2)]
        layers += [nn.LeakyReLU(0.2, inplace=True)]
    net = nn.Sequential(*layers, nn.Conv2d(WIDTH * 8, 1, 4, 1, 0, bias=False), nn.Sigmoid(), nn.Flatten(0))
    net.apply(weights_init)
    return net


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's real images and noise."""
    g = torch.Generator().manual_seed(7000 + step)
    real = torch.tanh(torch.randn(GLOBAL_BATCH, 3, 64, 64, generator=g) + 0.5)
    noise = torch.randn(GLOBAL_BATCH, NZ, 1, 1, generator=g)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return real[rows], noise[rows]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=20)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    net_g, net_d = generator(), discriminator()
    optimizer_d = torch.optim.Adam(net_d.parameters(), lr=0.0002, betas=(0.5, 0.999))
    optimizer_g = torch.optim.Adam(net_g.parameters(), lr=0.0002, betas=(0.5, 0.999))
    engine_d, _, _, _ = deepspeed.initialize(
        args=args, model=net_d, model_parameters=net_d.parameters(), optimizer=optimizer_d
    )
    engine_g, _, _, _ = deepspeed.initialize(
        args=args, model=net_g, model_parameters=net_g.parameters(), optimizer=optimizer_g
    )
    criterion = nn.BCELoss()
    losses: list[float] = []
    for step in range(args.steps):
        real, noise = batch(step, rank, world)
        ones, zeros = torch.ones(len(real)), torch.zeros(len(real))
        net_d.zero_grad()
        err_d_real = criterion(net_d(real), ones)
        engine_d.backward(err_d_real)
        fake = net_g(noise)
        err_d_fake = criterion(net_d(fake.detach()), zeros)
        engine_d.backward(err_d_fake)
        engine_d.step()
        net_g.zero_grad()
        err_g = criterion(net_d(fake), ones)  # the discriminator's module, not its engine
        engine_g.backward(err_g)
        engine_g.step()
        three = torch.stack([err_d_real.detach(), err_d_fake.detach(), err_g.detach()])
        deepspeed.comm.all_reduce(three)
        losses += (three / world).tolist()
    if rank == 0:
        write_losses("gan_adam", losses)
    # Every rank leaves together and the group is torn down before exit: a gloo group destroyed at
    # interpreter exit while a peer still holds its side can abort the process (torchrun then fails the run).
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
