with pr as (select revision, created_at as pub, try_cast(json_extract(metrics,'$.step_s') as double) as step_s from policy_revisions),
ro as (select policy_revision r, evaluation,
  min(created_at) first_ro, max(created_at) last_ro, count(*) n from rollouts group by 1,2),
tb as (select target_revision r, max(created_at) batch_at from trainer_batches group by 1)
select p.revision as r,
  round(epoch(t.last_ro) - epoch(p.pub),2) as gen_s,
  round(epoch(e.last_ro) - epoch(p.pub),2) as eval_end_s,
  round(epoch(b.batch_at) - epoch(t.last_ro),2) as to_batch_s,
  round(epoch(n.pub) - epoch(b.batch_at),2) as batch_to_pub_s,
  round(n.step_s,2) step_s,
  round(epoch(n.pub) - epoch(p.pub),2) as period_s
from pr p left join ro t on t.r=p.revision and not t.evaluation
left join ro e on e.r=p.revision and e.evaluation
left join tb b on b.r=p.revision
left join pr n on n.revision=p.revision+1
order by 1
