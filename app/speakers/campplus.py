"""CAM++ speaker-embedding network (inference only), for 3D-Speaker's released weights.

The architecture of 3D-Speaker's ``speakerlab/models/campplus/{DTDNN,layers}.py``
(Copyright 3D-Speaker, https://github.com/modelscope/3D-Speaker, Apache License 2.0), kept
layer for layer so the released state dict (``campplus_cn_en_common.pt``, 192-d) loads with
``strict=True``; only training-time code (gradient checkpointing, other configurations) is
left out. No package on PyPI ships this network without 3D-Speaker's, FunASR's or
ModelScope's whole toolkits, so it lives here: the weights are what matter and they are
checked by digest when provisioned (``models/registry.py``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn


def _bn_relu(channels: int, affine: bool = True) -> nn.Sequential:
    seq = nn.Sequential()
    seq.add_module("batchnorm", nn.BatchNorm1d(channels, affine=affine))
    if affine:
        seq.add_module("relu", nn.ReLU(inplace=True))
    return seq


class BasicResBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=(stride, 1), padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=(stride, 1), bias=False),
                nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class FCM(nn.Module):
    """Front-end 2-D convolution module over (frequency, time)."""

    def __init__(self, m_channels: int = 32, feat_dim: int = 80) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, m_channels, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(m_channels)
        self.layer1 = nn.Sequential(BasicResBlock(m_channels, m_channels, 2),
                                    BasicResBlock(m_channels, m_channels, 1))
        self.layer2 = nn.Sequential(BasicResBlock(m_channels, m_channels, 2),
                                    BasicResBlock(m_channels, m_channels, 1))
        self.conv2 = nn.Conv2d(m_channels, m_channels, 3, stride=(2, 1), padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(m_channels)
        self.out_channels = m_channels * (feat_dim // 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x.unsqueeze(1))))
        out = self.layer2(self.layer1(out))
        out = F.relu(self.bn2(self.conv2(out)))
        b, c, f, t = out.shape
        return out.reshape(b, c * f, t)


class TDNNLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        self.linear = nn.Conv1d(in_channels, out_channels, kernel_size, stride=stride,
                                padding=(kernel_size - 1) // 2, bias=False)
        self.nonlinear = _bn_relu(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nonlinear(self.linear(x))


class CAMLayer(nn.Module):
    """Context-aware masking: a local convolution gated by utterance and segment context."""

    def __init__(self, bn_channels: int, out_channels: int, kernel_size: int, dilation: int) -> None:
        super().__init__()
        self.linear_local = nn.Conv1d(bn_channels, out_channels, kernel_size,
                                      padding=(kernel_size - 1) // 2 * dilation,
                                      dilation=dilation, bias=False)
        self.linear1 = nn.Conv1d(bn_channels, bn_channels // 2, 1)
        self.relu = nn.ReLU(inplace=True)
        self.linear2 = nn.Conv1d(bn_channels // 2, out_channels, 1)
        self.sigmoid = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_local(x)
        context = x.mean(-1, keepdim=True) + self.seg_pooling(x)
        return y * self.sigmoid(self.linear2(self.relu(self.linear1(context))))

    @staticmethod
    def seg_pooling(x: torch.Tensor, seg_len: int = 100) -> torch.Tensor:
        seg = F.avg_pool1d(x, kernel_size=seg_len, stride=seg_len, ceil_mode=True)
        shape = seg.shape
        seg = seg.unsqueeze(-1).expand(*shape, seg_len).reshape(*shape[:-1], -1)
        return seg[..., : x.shape[-1]]


class CAMDenseTDNNLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, bn_channels: int, kernel_size: int,
                 dilation: int) -> None:
        super().__init__()
        self.nonlinear1 = _bn_relu(in_channels)
        self.linear1 = nn.Conv1d(in_channels, bn_channels, 1, bias=False)
        self.nonlinear2 = _bn_relu(bn_channels)
        self.cam_layer = CAMLayer(bn_channels, out_channels, kernel_size, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.cam_layer(self.nonlinear2(self.linear1(self.nonlinear1(x))))
        return out


class CAMDenseTDNNBlock(nn.ModuleList):
    def __init__(self, num_layers: int, in_channels: int, out_channels: int, bn_channels: int,
                 kernel_size: int, dilation: int) -> None:
        super().__init__()
        for i in range(num_layers):
            self.add_module(f"tdnnd{i + 1}", CAMDenseTDNNLayer(
                in_channels + i * out_channels, out_channels, bn_channels, kernel_size, dilation))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = torch.cat([x, layer(x)], dim=1)
        return x


class TransitLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.nonlinear = _bn_relu(in_channels)
        self.linear = nn.Conv1d(in_channels, out_channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(self.nonlinear(x))
        return out


class StatsPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.mean(dim=-1), x.std(dim=-1, unbiased=True)], dim=-1)


class DenseLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.linear = nn.Conv1d(in_channels, out_channels, 1, bias=False)
        self.nonlinear = _bn_relu(out_channels, affine=False)  # 3D-Speaker's "batchnorm_"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.nonlinear(self.linear(x.unsqueeze(-1)).squeeze(-1))
        return out


class CAMPPlus(nn.Module):
    """(batch, frames, 80) mean-normalised log-mel fbank -> (batch, embedding_size)."""

    def __init__(self, feat_dim: int = 80, embedding_size: int = 192, growth_rate: int = 32,
                 bn_size: int = 4, init_channels: int = 128) -> None:
        super().__init__()
        self.head = FCM(feat_dim=feat_dim)
        channels = init_channels
        self.xvector = nn.Sequential(OrderedDict(
            [("tdnn", TDNNLayer(self.head.out_channels, init_channels, 5, stride=2))]))
        for i, (num_layers, dilation) in enumerate(((12, 1), (24, 2), (16, 2))):
            self.xvector.add_module(f"block{i + 1}", CAMDenseTDNNBlock(
                num_layers, channels, growth_rate, bn_size * growth_rate, 3, dilation))
            channels += num_layers * growth_rate
            self.xvector.add_module(f"transit{i + 1}", TransitLayer(channels, channels // 2))
            channels //= 2
        self.xvector.add_module("out_nonlinear", _bn_relu(channels))
        self.xvector.add_module("stats", StatsPool())
        self.xvector.add_module("dense", DenseLayer(channels * 2, embedding_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.xvector(self.head(x.permute(0, 2, 1)))
        return out
