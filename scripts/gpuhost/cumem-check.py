# One process on the GPU host: the GPU UUID as the mailbox names it, NVML peer status,
# a cuMem box created, viewed as a tensor and imported back (scripts/gpuhost/README.md).
import torch, subprocess
from lamport_head import mailbox, peermem
d = torch.device("cuda", 0)
print("uuid raw:", torch.cuda.get_device_properties(d).uuid, "key:", mailbox.device_key(d))
print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip())
key = mailbox.device_key(d)[1]
print("p2p self (expect ok or not-supported):", peermem.p2p_status(key, key))
print("p2p unknown:", peermem.p2p_status(key, "GPU-00000000-0000-0000-0000-000000000000"))
seg = peermem.CudaSegments(d)
s = seg.create(1 << 20)
t = seg.tensor(s, (1 << 20) // 4)
t.fill_(7); torch.cuda.synchronize()
print("cuMem box:", s.size, hex(s.ptr), "fd", s.fd, "sum", int(t.sum().item()), t.device)
o = seg.open(s.fd, s.size)
u = seg.tensor(o, 4); print("self-import reads", u.tolist())
seg.close(o); del t, u; seg.close(s); print("closed")
