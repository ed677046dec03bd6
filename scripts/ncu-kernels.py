#!/usr/bin/env python3
"""Per-kernel table of one decode token from ncu's raw CSV (docs/PERF.md, session 6).

On the GPU machine:
  ncu --graph-profiling node --cache-control none --clock-control none \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --page raw \
      strata bench model -m FILE --backend cuda -p 0 -n 2 -r 1 --no-warmup > ncu.csv
  python3 scripts/ncu-kernels.py ncu.csv [KERNELS_PER_TOKEN]

Takes the last KERNELS_PER_TOKEN kernel rows (default 1370: the full-size file's decode step)
and prints their summed duration and DRAM bytes, then the 32 costliest kernels by name:
launches, total µs, µs a launch, MB read and GB/s.
"""
import csv,io,collections,sys
txt=open(sys.argv[1]).read().splitlines()
start=[i for i,l in enumerate(txt) if l.startswith('"ID"')][0]
rows=list(csv.reader(io.StringIO("\n".join(l for l in txt[start:] if l.startswith('"')))))
h=rows[0]; data=rows[2:]
ix={n:i for i,n in enumerate(h)}
N=int(sys.argv[2]) if len(sys.argv)>2 else 1370
last=data[-N:]
def f(r,k):
    v=r[ix[k]].replace(',','')
    return float(v) if v else 0
tot=sum(f(r,'gpu__time_duration.sum') for r in last); byt=sum(f(r,'dram__bytes_read.sum') for r in last)
print("kernels",len(last),"sum dur us",tot/1000,"bytes MB",byt/1e6)
agg=collections.defaultdict(lambda:[0,0,0])
for r in last:
    n=r[ix['Kernel Name']]
    a=agg[n]; a[0]+=1; a[1]+=f(r,'gpu__time_duration.sum'); a[2]+=f(r,'dram__bytes_read.sum')
for n,a in sorted(agg.items(), key=lambda x:-x[1][1])[:32]:
    print(f"{n[:34]:34s} {a[0]:5d} {a[1]/1000:8.1f}us {a[1]/a[0]/1000:6.2f}us/l {a[2]/1e6:8.2f}MB {a[2]/max(a[1],1):6.0f}GB/s")
